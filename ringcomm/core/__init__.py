"""The bottom layer: dtypes, reductions and the arrays the executor works on.

Knows nothing of links, schedules or torch; everything above may import it.
"""
