"""The residency engine's switches, as the program is told them at boot.

Users and tests set them as variables in the environment of the command that starts the program
(`gpu-prefetch-sched run`, `gpu-ckpt run`, `gpu-trace run --agent`); the launcher reads them
there (`from_environment`) into the boot config, and the engine takes them from that object,
never from the program's environment. What each switch is for: docs/residency-engine.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NO_DIGEST_ENV = "GPUOS_ENGINE_NO_DIGEST"  #: 1: no digest of host copies (every eviction saves)
NO_CONSERVE_ENV = "GPUOS_ENGINE_NO_CONSERVE"  #: 1: mismatches reported, not acted on
DIGEST_OFF_AFTER_ENV = "GPUOS_ENGINE_DIGEST_OFF_AFTER"  #: N: the digest check goes off after the Nth mismatch
NO_YIELD_ENV = "GPUOS_ENGINE_NO_YIELD"  #: 1: the background loader does not pause for demand loads
NO_PARK_ENV = "GPUOS_ENGINE_NO_PARK"  #: 1: released physical memory goes back to the driver at once
#: 1: records whose torch blocks are all freed are saved and loaded like the others
KEEP_DEAD_ENV = "GPUOS_ENGINE_KEEP_DEAD"
#: 0: under `gpu-prefetch-sched run` on the native core, every operation enters Python (the fast
#: path, on by default there, lets operations with nothing to do skip it)
FAST_ENV = "GPUOS_SCHED_FAST"
#: 0: under `gpu-prefetch-sched run`, an eviction's save waits for everything the program has
#: enqueued, not only for the record's last use
LAST_USE_ENV = "GPUOS_SCHED_LAST_USE"
#: 1: under `gpu-prefetch-sched run --plan fixed`, the plan asks where its records are dead and is
#: made again to drop them there (their evictions and loads move nothing either way, with
#: ``KEEP_DEAD_ENV`` unset)
DEAD_PLAN_ENV = "GPUOS_SCHED_DEAD_PLAN"
#: 0: under `gpu-prefetch-sched run --plan fixed`, the plan makes a load later than its copy takes
#: before it drops another record (on by default: it drops another record first)
KEEP_LEADS_ENV = "GPUOS_SCHED_KEEP_LEADS"
#: every variable above: the launcher reads them and leaves them out of the program's environment
VARIABLES = (NO_DIGEST_ENV, NO_CONSERVE_ENV, DIGEST_OFF_AFTER_ENV, NO_YIELD_ENV, NO_PARK_ENV, KEEP_DEAD_ENV, FAST_ENV,
             LAST_USE_ENV, DEAD_PLAN_ENV, KEEP_LEADS_ENV)


@dataclass(frozen=True)
class EngineSettings:
    """The engine's switches; the defaults are what a user runs."""

    digest: bool = True  #: digest host copies, so that an unchanged record is evicted without a save
    conserve: bool = True  #: after a mismatch, the kernels that may have written are treated as unknown
    digest_off_after: int = 0  #: turn the digest check off after this many mismatches (0: never)
    yield_to_demand: bool = True  #: the background loader pauses while a demand load is in flight
    park: bool = True  #: keep released physical memory parked for reuse (`gpu-prefetch-sched run`)
    #: a record whose every torch block the program has freed holds nothing a tensor will read
    #: before writing it: its eviction saves nothing and its load copies nothing back (the
    #: memory is mapped, its contents undefined, as a fresh allocation's are)
    drop_dead: bool = True
    #: the scheduler's fast path on the native core (docs/native-core.md, "The fast path"): an
    #: operation whose records are all resident and settled, and for which the policy's plan has
    #: no action, goes on without entering Python; its bookkeeping is replayed in batches. On by
    #: default: its decisions are the ones every call would give, and on the GPU the jobs' results
    #: were bit-identical to the job alone (serve's jobs never take it)
    fast: bool = True
    #: the scheduler's evictions wait on the GPU for the record's last use (an event on the
    #: program's stream before each operation that enters Python), not for everything the program
    #: has enqueued: a host running ahead of the GPU gets its room back as soon as the GPU has
    #: passed the victim (docs/scheduler.md, "The executor"). Programs on the legacy default
    #: stream only
    last_use: bool = True
    #: a fixed plan's first period asks at one phase in eight which of its records are dead, and
    #: the plan is made again with it: a record dropped where it is dead moves no bytes. Off by
    #: default: on ResNet-50 training it halved the bytes but doubled the evictions, and the
    #: loop, bound by the host's decisions, ran slower (docs/scheduler.md, the fixed plan's
    #: "Dead records"); needs ``drop_dead``
    dead_plan: bool = False
    #: a fixed plan over its budget at a phase drops another record (bytes) before it makes a
    #: load later than its copy takes (a load the GPU waits for; at the use itself, one the
    #: program's thread makes): on ResNet-50 training at 66 % the step went from 118 to 100 ms
    #: (docs/scheduler.md, the fixed plan)
    keep_leads: bool = True

    def __post_init__(self) -> None:
        if self.digest_off_after < 0:
            raise ValueError(f"{DIGEST_OFF_AFTER_ENV}: {self.digest_off_after} is negative")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> EngineSettings:
        """The switches the variables above set in ``environ``; ValueError naming the variable
        for a value that is not one it takes."""

        def flag(name: str, default: bool = False) -> bool:  # "1": set; "0": not; unset or empty: the default
            value = environ.get(name, "").strip()
            if value not in ("", "0", "1"):
                raise ValueError(f"{name}={value!r}: expected 1 (or 0, or unset)")
            return default if value == "" else value == "1"

        text = environ.get(DIGEST_OFF_AFTER_ENV, "").strip()
        try:
            off_after = int(text) if text else 0
        except ValueError:
            off_after = -1
        if off_after < 0:
            raise ValueError(f"{DIGEST_OFF_AFTER_ENV}={text!r}: expected a number of mismatches, 0 or more")
        return cls(digest=not flag(NO_DIGEST_ENV), conserve=not flag(NO_CONSERVE_ENV), digest_off_after=off_after,
                   yield_to_demand=not flag(NO_YIELD_ENV), park=not flag(NO_PARK_ENV),
                   drop_dead=not flag(KEEP_DEAD_ENV), fast=flag(FAST_ENV, default=True),
                   last_use=flag(LAST_USE_ENV, default=True), dead_plan=flag(DEAD_PLAN_ENV),
                   keep_leads=flag(KEEP_LEADS_ENV, default=True))
