"""What every rank decides identically before and during an op: the facts about where ranks
are (``topology``), the settings they agreed (``settings``) and the cost model that picks a
schedule (``cost``). Pure functions of agreed inputs, so ranks can never choose differently.
"""
