"""What the soak's project defines, and the modes a soak runs in; importable
without building its Celery app (which reads its broker, queue and mode from
the environment at import).

A mode is comma-joined dimensions, each with a default:

- workers: ``tracked`` (``celery_sched.tracking.install``) or ``untracked``
  (stock workers, the drop-in: plain tasks only, since ``celery_sched.Task``
  installs tracking itself);
- tasks: ``mixed`` (plain tasks and ``celery_sched.Task``; tracked default),
  ``plain`` (untracked default) or ``task``;
- ``shards<N>``: N shards shared by the beats, no pin (default ``shards1``);
- ``dense``: 150+ partitions of jobs scheduled up front, most in the future;
- ``clients``: API clients in threads (3x the store pool) under the faults.

``untracked,shards16,dense`` is one mode; ``all`` is each of :data:`ALL` in turn.
"""

from __future__ import annotations

import dataclasses
import re

#: Tables of evidence, created in the soak database's ``public`` schema.
TABLES = (
    "CREATE TABLE IF NOT EXISTS soak_runs (job_id text, key text, task text, attempt int, "
    "pid int, hostname text, started double precision)",
    "CREATE INDEX IF NOT EXISTS soak_runs_job_id ON soak_runs (job_id)",
    "CREATE TABLE IF NOT EXISTS soak_effects (key text, job_id text, pid int, at double precision)",
)

#: Periodic schedules: name -> (task, interval in seconds).
PERIODIC = {
    "soak-plain-2s": ("soak.periodic_plain", 2.0),
    "soak-plain-5s": ("soak.periodic_plain", 5.0),
    "soak-task-3s": ("soak.periodic_task", 3.0),
    "soak-task-5s": ("soak.periodic_task", 5.0),
}

#: Plain Celery tasks (at-least-once; a duplicate run is allowed).
PLAIN_TASKS = ("soak.plain", "soak.periodic_plain")
#: Tasks whose every key must have its effect exactly once.
EFFECT_TASKS = ("soak.effect", "soak.periodic_task")

#: The one-off tasks of the job stream, by the ``tasks`` dimension.
TASK_SETS = {
    "mixed": ("soak.plain", "soak.task", "soak.effect"),
    "plain": ("soak.plain",),
    "task": ("soak.task", "soak.effect"),
}

#: What ``--mode all`` runs, each alone (duplicates of the defaults, such
#: as ``shards1`` = ``tracked``, run once).
ALL = ("tracked", "untracked", "plain", "task", "shards1", "shards16", "dense", "clients")

_SHARDS = re.compile(r"shards(\d+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    workers: str = "tracked"
    tasks: str = "mixed"
    shards: int = 1
    dense: bool = False
    clients: bool = False

    @property
    def name(self) -> str:
        """The canonical spelling: the workers, then what differs from the defaults."""
        parts = [self.workers]
        if self.tasks != _default_tasks(self.workers):
            parts.append(self.tasks)
        if self.shards != 1:
            parts.append(f"shards{self.shards}")
        parts += [flag for flag in ("dense", "clients") if getattr(self, flag)]
        return ",".join(parts)

    @property
    def tracked(self) -> bool:
        return self.workers == "tracked"

    @property
    def one_off_tasks(self) -> tuple[str, ...]:
        return TASK_SETS[self.tasks]

    @property
    def periodic(self) -> dict[str, tuple[str, float]]:
        """The app's periodic schedules in this mode."""
        wanted = {
            "mixed": ("soak.periodic_plain", "soak.periodic_task"),
            "plain": ("soak.periodic_plain",),
            "task": ("soak.periodic_task",),
        }[self.tasks]
        return {name: spec for name, spec in PERIODIC.items() if spec[0] in wanted}

    def env(self) -> dict[str, str]:
        """What tells ``tests.soak.app`` (in the beats, the workers and the
        runner) the mode."""
        return {"SOAK_MODE": self.name}


def _default_tasks(workers: str) -> str:
    return "mixed" if workers == "tracked" else "plain"


def parse_mode(text: str) -> Mode:
    """The mode spelt ``text`` (comma-joined dimensions); ValueError naming
    the word at fault otherwise."""
    words = [word.strip().lower() for word in text.split(",")]
    if not text.strip() or "" in words:
        raise ValueError(f"mode {text!r}: an empty dimension")
    seen: dict[str, str] = {}

    def claim(dimension: str, word: str) -> None:
        if dimension in seen:
            raise ValueError(
                f"mode {text!r}: {seen[dimension]!r} and {word!r} are both {dimension}; "
                "give several --mode options to run several modes"
            )
        seen[dimension] = word

    workers, tasks, shards, flags = "tracked", "", 1, set()
    for word in words:
        match = _SHARDS.fullmatch(word)
        if word in ("tracked", "untracked"):
            claim("workers", word)
            workers = word
        elif word in TASK_SETS:
            claim("tasks", word)
            tasks = word
        elif match is not None:
            claim("shards", word)
            shards = int(match.group(1))
            if not 1 <= shards <= 256:
                raise ValueError(f"mode {text!r}: shards must be 1..256, got {shards}")
        elif word in ("dense", "clients"):
            claim(word, word)
            flags.add(word)
        else:
            raise ValueError(
                f"mode {text!r}: unknown dimension {word!r} (known: tracked, untracked, "
                "mixed, plain, task, shards<N>, dense, clients)"
            )
    tasks = tasks or _default_tasks(workers)
    if workers == "untracked" and tasks != "plain":
        raise ValueError(
            f"mode {text!r}: untracked workers run plain tasks only "
            "(celery_sched.Task installs tracking in the worker)"
        )
    return Mode(
        workers=workers,
        tasks=tasks,
        shards=shards,
        dense="dense" in flags,
        clients="clients" in flags,
    )


def parse_modes(values: list[str]) -> list[Mode]:
    """The ``--mode`` options in order (``all`` expands to :data:`ALL`),
    each distinct mode once."""
    modes: list[Mode] = []
    for value in values or ["tracked"]:
        for mode in [parse_mode(m) for m in ALL] if value.strip() == "all" else [parse_mode(value)]:
            if mode not in modes:
                modes.append(mode)
    return modes
