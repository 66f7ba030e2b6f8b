"""Checkpoints of a cluster run: every rank saves its own part of each job, and a resumed run
loads them back on the same ranks.

A job's state is spread over the ranks (a parameter server holds its shard's parameters and
optimizer state, each worker its own random stream and buffers; in all-reduce mode every
rank a replica), so each rank writes what *it* holds, with :meth:`Job.state_dict`, to
``checkpoints/<job_id>/rank<R>.it<N>.pt`` after iteration ``N`` (every ``run.checkpoint_every``
iterations and when the job ends). The file also carries the rank's iteration records (so the
resumed run's metrics cover the whole job) and how long the job had run.

All ranks reach the same iteration boundaries in the same order (the leader broadcasts every
step), but a kill can land while some ranks have written iteration ``N`` and others not yet:
each rank keeps its last two generations, and a resume takes the newest iteration that
*every* rank wrote. Each file is written atomically (temp file + rename).
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelopt.errors import UserError, listed
from accelopt.job.checkpoint import (
    CHECKPOINT_DIR,
    PLUGIN_SETTINGS,
    arrive_on_resumed_clock,
    carried_time,
    load_into,
    read_checkpoint,
    refuse_other_spec,
    resumed_clock,
    save_checkpoint,
)

if TYPE_CHECKING:
    from accelopt.drivers.cluster.rank import RankJob

KEEP = 2
"""Generations each rank keeps per job."""

_NAME = re.compile(r"^rank(\d+)\.it(\d+)\.pt$")


def job_dir(run_dir: str | Path, job_id: str) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / job_id


class RankCheckpointer:
    """Writes this rank's part of a job after the iterations that need a checkpoint."""

    def __init__(self, run_dir: str | Path, every: int, rank: int, world: int,
                 settings: dict[str, Any] | None = None) -> None:
        self.run_dir, self.every, self.rank, self.world = Path(run_dir), every, rank, world
        self.settings = settings
        """The run's plugin settings, recorded in every file beside its job spec
        (:data:`~accelopt.job.checkpoint.PLUGIN_SETTINGS`)."""
        self.clock_offset = 0.0
        """A resumed run: the clock of the run it resumed, which ``clock_s`` goes on from.
        ``clock_s`` is on the training clock (from ``train_t0``, when every rank had built
        every job), the clock a job's reported times are on
        (:func:`~accelopt.drivers.cluster.driver.on_training_clock`): a job that had arrived
        before the stop is at a negative arrival after the resume whatever either run's
        start-up took."""

    def after_step(self, part: RankJob) -> None:
        job = part.job
        if not self.every or (job.iteration % self.every and not job.done):
            return
        directory = job_dir(self.run_dir, job.info.job_id)
        state = {
            "job": job.state_dict(),
            "iterations": [{**r, "carried": True} for r in part.iterations],
            "elapsed_s": part.elapsed_s(),
            "service_s": part.service_s(),
            "queueing_s": part.queueing_s(),
            "spec": asdict(job.spec),
            "clock_s": self.clock_offset + part.now() - part.train_t0,
            "rank": self.rank,
            "world": self.world,
            PLUGIN_SETTINGS: self.settings,
        }
        save_checkpoint(state, directory / f"rank{self.rank}.it{job.iteration:08d}.pt")
        mine = sorted(_generations(directory).get(self.rank, []))
        for old in mine[:-KEEP]:
            (directory / f"rank{self.rank}.it{old:08d}.pt").unlink(missing_ok=True)


def _generations(directory: Path) -> dict[int, list[int]]:
    """rank -> the iterations it has a checkpoint of, in ``directory``."""
    out: dict[int, list[int]] = {}
    if directory.is_dir():
        for path in directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                out.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    return out


def refuse_other_ranks(directory: Path, generations: dict[int, list[int]], world: int) -> None:
    if sorted(generations) != list(range(world)):
        raise UserError(
            f"checkpoints in {directory} were written by ranks {sorted(generations)}, but this "
            f"run has {world} ranks; resume with the run's own cluster settings")


def refuse_unresumable(resume_dir: str | Path, job_id: str, spec: Any, world: int) -> None:
    """What :func:`restore_part` refuses, checked before a resumed run writes anything: the
    job's checkpoints written by another number of ranks, or for another job spec. A job
    whose files share no iteration is not refused but said (:func:`restart_note`), on
    stderr as the refusals are, once per job (each rank's restore finds the same)."""
    directory = job_dir(resume_dir, job_id)
    generations = _generations(directory)
    if not generations:
        return
    refuse_other_ranks(directory, generations, world)
    rank, iterations = min(generations.items())
    refuse_other_spec(directory / f"rank{rank}.it{max(iterations):08d}.pt", spec)
    note = restart_note(directory, job_id)
    if note:
        print(note, file=sys.stderr, flush=True)


def restart_note(directory: Path, job_id: str) -> str:
    """``note: ...`` where the job's checkpoints in ``directory`` exist but no iteration has
    a file of every rank (one rank's file of the newest common one deleted, say): the job
    restarts from scratch (:func:`restore_part`) and its iterations run again, which the
    resume's "resuming ... from its checkpoints" line alone hid. '' where there is an
    iteration to resume from, or no checkpoint at all (the resume says that already)."""
    generations = _generations(directory)
    if not generations or _common(generations):
        return ""
    has = [f"rank {rank} has {', '.join(str(i) for i in sorted(its))}"
           for rank, its in sorted(generations.items())]
    return (f"note: job {job_id}: no iteration every rank has a checkpoint of in {directory} "
            f"({listed(has, sep='; ')}); it restarts from scratch (its iterations run again)")


def _common(generations: dict[int, list[int]]) -> set[int]:
    """The iterations every rank in ``generations`` has a checkpoint of."""
    return set.intersection(*(set(v) for v in generations.values())) if generations else set()


def unreadable_hint(path: Path) -> str:
    """What deleting the unreadable rank file ``path`` does to its job's resume: the newest
    iteration every rank would still have, or the job's restart from scratch."""
    directory = path.parent
    match = _NAME.match(path.name)
    generations = _generations(directory)
    if match and generations:
        rank, iteration = int(match.group(1)), int(match.group(2))
        generations[rank] = [i for i in generations[rank] if i != iteration]
        common = _common(generations)
        then = (f"its job resumes from iteration {max(common)}, the newest every rank still "
                "has" if common else "its job restarts from scratch")
    else:
        then = "its job restarts from scratch"
    return (f"copy the run directory, delete the file in the copy and resume the copy: "
            f"{then} (the directory resumed is only read)")


def refuse_unreadable(resume_dir: str | Path) -> None:
    """Every rank file a resume carries must be readable, checked before it writes anything
    (it found a damaged file after the new directory held the carried files and the outputs
    of a run that never trained)."""
    for path in sorted((Path(resume_dir) / CHECKPOINT_DIR).rglob("*.pt")):
        read_checkpoint(path, unreadable_hint(path))


def restore_part(resume_dir: str | Path, part: RankJob, rank: int, world: int) -> bool:
    """Load this rank's part of ``part``'s job from the newest iteration every rank saved;
    ``False`` when there is none (the job starts from scratch). Either way its arrival moves
    onto the resumed run's clock, as a one-process resume's does
    (:func:`accelopt.job.checkpoint.arrive_on_resumed_clock`: every rank reads the same
    newest clock), and the rank's checkpointer goes on with the old run's clock."""
    job = part.job
    clock = resumed_clock(resume_dir)
    if part.checkpointer is not None:
        part.checkpointer.clock_offset = clock or 0.0
    arrive_on_resumed_clock(job, clock)
    directory = job_dir(resume_dir, job.info.job_id)
    generations = _generations(directory)
    if generations:
        refuse_other_ranks(directory, generations, world)
    common = _common(generations)
    if not common:
        return False
    state = load_into(directory / f"rank{rank}.it{max(common):08d}.pt", job)
    part.iterations = list(state["iterations"])
    part.carried_s = carried_time(state, job.done, clock)
    part.carried_service_s = float(state.get("service_s", 0.0))
    part.carried_queueing_s = state.get("queueing_s")  # absent from older checkpoints
    return True
