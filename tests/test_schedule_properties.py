"""Defining properties of the double binary tree, read off the schedules themselves.

``dbtree`` exists because one binary tree overloads its interior ranks (each receives
twice, sends twice and reduces twice the data) while its leaves idle. Two trees, each
carrying half of the data, with every rank interior in at most one of them, spread that
load. These tests rebuild, for every element of the data, the tree it is reduced over from
the steps of every rank (who receives-and-reduces that element from whom) and check the
properties a user relies on, for every world size from 2 to 32; they do not re-derive the
trees from ``dbtree``'s own helpers.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ringcomm.schedules import Kind, Region, dbtree

pytestmark = pytest.mark.timeout(60)

WORLDS = list(range(2, 33))
# (count, segment): several segments per half, an odd count (halves of unequal size), and
# one segment per half
SHAPES = [(64, 8), (37, 5), (10, 100)]

REDUCING = (Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND)


def elements(region: Region | None) -> range:
    return range(0) if region is None else range(region.offset, region.offset + region.count)


class ElementTree:
    """The tree one element is reduced over, as the schedules of all ranks say it is."""

    def __init__(self, n: int) -> None:
        self.n = n
        # (child, parent): rank `parent` receives the element from `child` and reduces it
        self.edges: list[tuple[int, int]] = []
        # ranks that receive the element as a plain copy (the result, on its way down)
        self.copies: Counter[int] = Counter()
        self.sends: Counter[tuple[int, int]] = Counter()  # (from, to) -> messages

    @property
    def parent(self) -> dict[int, int]:
        return dict(self.edges)

    def key(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.edges)

    def children(self, rank: int) -> list[int]:
        return [c for c, p in self.edges if p == rank]

    def interior(self, rank: int) -> bool:
        """Reduces data from a child and sends its partial sum on to a parent."""
        return bool(self.children(rank)) and rank in self.parent

    def check_spanning(self, what: str) -> int:
        """Assert the reduce edges form one tree over all ranks; return its root."""
        n, parent = self.n, self.parent
        assert len(self.edges) == n - 1, f"{what}: {len(self.edges)} reduce edges for {n} ranks"
        assert len(parent) == n - 1, f"{what}: a rank's partial sum was reduced twice"
        roots = set(range(n)) - set(parent)
        assert len(roots) == 1, f"{what}: roots {sorted(roots)}"
        (root,) = roots
        for r in range(n):  # every rank's contribution climbs to the root without a cycle
            seen, at = set(), r
            while at != root:
                assert at not in seen, f"{what}: cycle through rank {at}"
                seen.add(at)
                at = parent[at]
        return root


def element_trees(scheds: list, count: int) -> list[ElementTree]:
    """For every element, who reduces it from whom, who receives it, who sends it where."""
    trees = [ElementTree(len(scheds)) for _ in range(count)]
    for r, sched in enumerate(scheds):
        for step in sched.steps:
            if step.kind in REDUCING:
                for e in elements(step.dst):
                    trees[e].edges.append((step.peer, r))
            if step.kind is Kind.RECV_REDUCE_SEND:
                for e in elements(step.src):
                    trees[e].sends[(r, step.to)] += 1
            elif step.kind is Kind.RECV:
                for e in elements(step.dst):
                    trees[e].copies[r] += 1
            elif step.kind is Kind.SEND:
                for e in elements(step.src):
                    trees[e].sends[(r, step.peer)] += 1
    return trees


def schedules(world: int, count: int, segment: int) -> list:
    return [dbtree.allreduce(r, world, count, segment) for r in range(world)]


@pytest.mark.parametrize("count,segment", SHAPES)
@pytest.mark.parametrize("world", WORLDS)
def test_every_element_is_reduced_over_a_tree_of_all_ranks_and_sent_back_to_all(
        world, count, segment):
    scheds = schedules(world, count, segment)
    for e, tree in enumerate(element_trees(scheds, count)):
        root = tree.check_spanning(f"world {world}, element {e}")
        # a partial sum goes up each edge exactly once...
        for child, parent in tree.edges:
            assert tree.sends[(child, parent)] >= 1, (world, e, child, parent)
        # ...and the result comes down: every rank but the root receives it exactly once
        assert tree.copies[root] == 0, (world, e)
        assert all(tree.copies[r] == 1 for r in range(world) if r != root), \
            (world, e, dict(tree.copies))


@pytest.mark.parametrize("count,segment", SHAPES)
@pytest.mark.parametrize("world", WORLDS)
def test_two_trees_each_carrying_half_and_each_rank_interior_in_at_most_one(
        world, count, segment):
    scheds = schedules(world, count, segment)
    per_element = element_trees(scheds, count)
    trees: dict[frozenset, list[int]] = {}
    for e, tree in enumerate(per_element):
        trees.setdefault(tree.key(), []).append(e)
    assert len(trees) == 2, f"world {world}: {len(trees)} distinct reduction trees, want 2"
    (a_elems, a), (b_elems, b) = [(elems, per_element[elems[0]]) for elems in trees.values()]
    # each tree carries one contiguous half of the data
    for elems in (a_elems, b_elems):
        assert elems == list(range(elems[0], elems[-1] + 1)), elems
    assert abs(len(a_elems) - len(b_elems)) <= 1, (len(a_elems), len(b_elems))
    for r in range(world):
        assert not (a.interior(r) and b.interior(r)), (
            f"world {world}: rank {r} reduces and forwards in both trees "
            f"(children {a.children(r)} and {b.children(r)})")
    # stronger, as the module documents: no rank has children in both trees, except rank 0
    # for an odd world (root of one tree with a single child)
    both = [r for r in range(world) if a.children(r) and b.children(r)]
    assert both == ([] if world % 2 == 0 else [0]), f"world {world}: {both}"


@pytest.mark.parametrize("world", WORLDS)
def test_no_rank_carries_more_than_about_a_ring_ranks_load(world):
    """The point of the second tree: every rank reduces at most about N elements and
    receives at most about 2N, as a ring rank does (one tree: an interior rank reduces 2N
    and receives 3N)."""
    count, segment = 64, 8
    for r, sched in enumerate(schedules(world, count, segment)):
        reduced = sum(s.dst.count for s in sched.steps if s.kind in REDUCING)
        received = sum(s.dst.count for s in sched.steps
                       if s.kind in (*REDUCING, Kind.RECV))
        sent, sent_elems = sched.messages()
        assert reduced <= count, (world, r, reduced)
        assert received <= 2 * count, (world, r, received)
        assert sent_elems <= 2 * count, (world, r, sent_elems)
