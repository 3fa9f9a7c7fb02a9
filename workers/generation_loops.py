"""The scheduler's generation loops: the stable engine's, the canary's, and those retiring after a swap.

Generations (:class:`~workers.generation.sequence.GenSequence`) wait in :attr:`GenerationLoops.waiting`
until a loop admits them between its decode steps, then stay in :attr:`GenerationLoops.live` until their
outcome is reported. A swap (:meth:`workers.scheduler.Scheduler.swap`) gives new sequences a new loop;
the old one retires: it is stepped until its running sequences finish on the engine they started on.

Not thread-safe: :meth:`~GenerationLoops.replace`, :meth:`~GenerationLoops.loops`,
:meth:`~GenerationLoops.admit`, :meth:`~GenerationLoops.prune_retiring` and
:attr:`~GenerationLoops.active` are called with the scheduler's lock held; :meth:`~GenerationLoops.step`
and :meth:`~GenerationLoops.report_ended` run on the scheduler thread, which alone touches ``live``.
"""

from __future__ import annotations

import logging

from protocol.errors import RequestCancelled, RequestExpired
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence
from workers.jobs import JobOutcome, OutcomeObserver, Role, Served, report_outcomes

__all__ = ["GenWork", "GenerationLoops"]

log = logging.getLogger("fleet.scheduler")

GenWork = list[tuple[GenerationLoop, list[GenSequence]]]
"""Each joinable loop with the sequences joining it at its next step."""


class GenerationLoops:
    """The loops generations run on, the sequences waiting to join one, and those running."""

    def __init__(self, stable: GenerationLoop | None) -> None:
        self.stable = stable
        """The stable engine's loop (None: the model cannot generate)."""
        self.canary: GenerationLoop | None = None
        """The canary engine's loop (None: no canary, or one that cannot generate)."""
        self.retiring: list[GenerationLoop] = []
        """Loops swapped out, kept (and stepped) while they have running sequences."""
        self.waiting: list[GenSequence] = []
        """Generations handed over and not admitted to a loop yet, oldest first."""
        self.live: list[GenSequence] = []
        """Generations admitted to a loop and not yet reported to the outcome observers."""

    def replace(self, role: Role, loop: GenerationLoop | None, *, loaded: bool = True) -> None:
        """New sequences of ``role`` join ``loop`` from now on; the loop they joined before retires.

        ``loaded`` False (the canary dropped): no loop serves the canary role from now on.
        """
        old = self.canary if role == "canary" else self.stable
        if old is not None and old is not loop:
            self.retiring.append(old)  # kept (and stepped) while it has running sequences
        if role == "canary":
            self.canary = loop if loaded else None
        else:
            self.stable = loop

    def loops(self, stable: Served, canary: Served | None) -> list[tuple[GenerationLoop, Served]]:
        """The generation loops new sequences may join, with the engine of each (``stable``, ``canary``: the
        scheduler's engines now)."""
        loops = [] if self.stable is None else [(self.stable, stable)]
        if self.canary is not None and canary is not None:
            loops.append((self.canary, canary))
        return loops

    def admit(self, stable: Served, canary: Served | None) -> GenWork:
        """Each joinable loop with the waiting sequences it admits now, taken out of :attr:`waiting`.

        A canary-role sequence joins the canary's loop when one is loaded, else the stable loop. A waiting
        sequence that was cancelled or passed its deadline is handed to its loop at once, whatever room the
        loop has, and the step refuses it unrun (:meth:`GenerationLoop.step`): behind a full batch it would
        otherwise hold its worker slot (and its place in line) until the batch had room for it.
        """
        work: GenWork = []
        canary_loop = self.canary if canary is not None else None
        for loop, served in self.loops(stable, canary):
            mine = [
                q for q in self.waiting
                if (q.role == "canary" and canary_loop is not None) == (loop is canary_loop)
            ]
            doomed = [q for q in mine if _ends_unrun(q, loop)]
            if doomed:
                mine = [q for q in mine if q not in doomed]
            joiners = doomed + (mine[: loop.admissible(mine)] if mine else [])
            for seq in joiners:
                seq.served_version, seq.served_role = served.version, served.role
            if joiners:
                taken = set(map(id, joiners))
                self.waiting = [q for q in self.waiting if id(q) not in taken]
                self.live.extend(joiners)
            work.append((loop, joiners))
        return work

    def prune_retiring(self) -> None:
        """Forget the retiring loops whose sequences have all finished."""
        self.retiring = [loop for loop in self.retiring if loop.has_work()]

    @property
    def active(self) -> int:
        """Generations waiting to join or admitted and not ended (on any loop, retiring ones included)."""
        loops = [self.stable, self.canary, *self.retiring]
        return len(self.waiting) + sum(loop.active for loop in loops if loop is not None)

    def step(self, work: GenWork) -> None:
        """One step of each retiring loop not in ``work``, then of each loop in ``work`` that has joiners or
        running sequences. A step that raises fails that loop's sequences, not the others."""
        current = [loop for loop, _ in work]
        for old in list(self.retiring):  # sequences started on a swapped-out engine finish there
            if old not in current:
                _step(old, [])
        for loop, joiners in work:
            if joiners or loop.has_work():
                _step(loop, joiners)

    def report_ended(self, observers: list[OutcomeObserver]) -> None:
        """Hand the generations that ended since the last step to the outcome observers (one call).

        A generation refused unrun because its caller cancelled it or its deadline passed is not an outcome
        of the version (one-step requests the batch window drops are not reported either): counted as a
        failure, a burst of client cancels would roll a good canary back."""
        ended = [q for q in self.live if q.future.done()]
        if not ended:
            return
        self.live = [q for q in self.live if not q.future.done()]
        outcomes = [
            JobOutcome(q.served_version, q.served_role, q.future.exception() is None, q.submitted_unix_s, q.role)
            for q in ended
            if not isinstance(q.future.exception(), RequestCancelled | RequestExpired)
        ]
        if outcomes:
            report_outcomes(observers, outcomes)


def _ends_unrun(seq: GenSequence, loop: GenerationLoop) -> bool:
    """True when a waiting ``seq`` will be refused at ``loop``'s next step: cancelled, or past its deadline by
    the loop's clock (read now, so also at the step, which reads it later)."""
    return seq.cancel_requested or (seq.deadline_s is not None and loop.clock() > seq.deadline_s)


def _step(loop: GenerationLoop, joiners: list[GenSequence]) -> None:
    try:
        loop.step(joiners)
    except Exception as exc:  # an engine failure ends the running generations, not the worker
        log.exception("generation step failed")
        for seq in joiners:
            if not seq.future.done():
                seq.future.set_exception(exc)
        loop.fail_all(exc)
