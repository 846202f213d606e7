"""The quorum book of a live run (elastic.train.membership), its decisions on their own:
who is in the next quorum, in which order (rank 0 holds the state), who copies it, and
that a quorum waits for every live member and never for a dead one. Threads stand in
for the workers asking (the real ones are Ray actors: tests/test_live.py)."""

from __future__ import annotations

import threading

import pytest

from elastic.train.membership import Quorums


class Book:
    """A quorum book whose liveness answers come from ``dead`` (Ray's, in the run)."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.quorums = Quorums(lambda names: {n for n in names if n not in self.dead}, 0.01)

    def ask_all(self, asks: list[tuple[str, int, int]], expected: int = 0) -> dict:
        """Each (member, leaving, step) asks in a thread of its own; what each got."""
        got: dict = {}

        def ask(member: str, leaving: int, step: int) -> None:
            for _ in range(500):
                m = self.quorums.ask(member, leaving, step, expected, 0.05)
                if m is not None:
                    got[member] = m
                    return

        threads = [threading.Thread(target=ask, args=a) for a in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got


def test_the_first_quorum_waits_for_every_worker_and_orders_them_by_slot():
    book = Book()
    got = book.ask_all([("2.30", -1, 40), ("0.10", -1, 40), ("1.20", -1, 40)], expected=3)
    m = got["0.10"]
    assert got["2.30"] is m and m.members == ["0.10", "1.20", "2.30"]
    assert m.step == 40 and m.fresh == [] and m.id == 0


def test_a_dead_member_is_left_out_and_a_newcomer_copies_from_the_eldest():
    book = Book()
    first = book.ask_all([("0.10", -1, 0), ("1.20", -1, 0), ("2.30", -1, 0)], expected=3)["0.10"]
    book.dead.add("0.10")  # the eldest (rank 0) dies at step 7
    second = book.ask_all([("1.20", first.id, 7), ("2.30", first.id, 7)])["1.20"]
    assert second.members == ["1.20", "2.30"] and second.step == 7 and second.fresh == []
    # Ray's worker in slot 0's place asks while the others train; they leave at step 9
    got = book.ask_all([("0.40", -1, 0), ("1.20", second.id, 9), ("2.30", second.id, 9)])
    third = got["0.40"]
    assert got["1.20"] is third and third.id > second.id
    assert third.members == ["1.20", "2.30", "0.40"] and third.fresh == ["0.40"]
    assert third.rank("1.20") == 0 and third.step == 9  # the source holds the state
    # once it copied the state it holds it: the next quorum counts it in
    fourth = book.ask_all([(m, third.id, 12) for m in third.members])["0.40"]
    assert fourth.fresh == [] and fourth.members == third.members
    history = book.quorums.history
    assert [h["gone"] for h in history] == [[], ["0.10"], [], []]


def test_members_at_different_steps_cannot_form_a_quorum():
    book = Book()
    first = book.ask_all([("0.10", -1, 0), ("1.20", -1, 0)], expected=2)["0.10"]
    with pytest.raises(RuntimeError, match=r"left it at different steps \[5, 6\]"):
        book.quorums.ask("0.10", first.id, 5, 0, 0.01)
        book.quorums.ask("1.20", first.id, 6, 0, 0.01)


def test_when_every_member_is_dead_the_book_starts_over_without_reusing_an_id():
    book = Book()
    first = book.ask_all([("0.10", -1, 0), ("1.20", -1, 0)], expected=2)["0.10"]
    assert book.quorums.live_id() == first.id
    book.dead |= {"0.10", "1.20"}
    assert book.quorums.live_id() == -1  # Ray Train restarted the group: a first quorum
    again = book.ask_all([("0.50", -1, 30), ("1.60", -1, 30)], expected=2)["0.50"]
    assert again.members == ["0.50", "1.60"] and again.id > first.id and again.step == 30
