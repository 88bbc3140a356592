"""Node-local knobs that benches and tests turn: one frozen value, passed to the services whole.

None of these is part of the run's identity (peers with different knobs still train together);
each default is what a real peer should use. The CLI sets them with ``--tune KEY=VALUE``
(``p2pswarm join --help``); a service never reads an environment variable for them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from p2pswarm.errors import ConfigError

MIN_IN_FLIGHT = 2  # stage-0 micro-batches between being cut and their gradient coming back: one per stage (1F1B)
EVAL_SHARE = 10  # a held-out round that takes t seconds waits (EVAL_SHARE - 1) x t before the next: 1/10 of the time
SUMMARY_PERIOD_S = 60.0  # the node's summary log line: once a minute (node/summary.py)
LINK_DELAY_S = 0.0  # latency added before each activation frame is written: none on a real line (benches add 50 ms)


@dataclass(frozen=True)
class Tunables:
    """Knobs of one peer. ``max_in_flight`` None: ``max(MIN_IN_FLIGHT, stages)``, one micro-batch per stage."""

    eval_share: int = EVAL_SHARE  # 1: evaluate after every outer round (tests that need a figure per round)
    max_in_flight: int | None = None  # stage 0's in-flight bound (the staleness ablation's arm)
    affinity: bool = True  # prefer one partner of the next stage (False: the ablation's arm)
    link_delay_s: float = LINK_DELAY_S  # simulated per-frame latency (bench/swarm_train.py's delay arm)
    alone_adopts: bool = False  # a DiLoCo round of one adopts its weights as they are (the benches' ablation arm)
    summary_period_s: float = SUMMARY_PERIOD_S  # the summary log line's period (tests shorten it)

    def __post_init__(self) -> None:
        if self.eval_share < 1:
            raise ConfigError(f"eval_share must be >= 1, not {self.eval_share}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, not {self.max_in_flight}")
        if not 0.0 <= self.link_delay_s <= 10.0:
            raise ConfigError(f"link_delay_s must be within 0..10 s, not {self.link_delay_s}")
        if not 1.0 <= self.summary_period_s <= 86400.0:
            raise ConfigError(f"summary_period_s must be within 1..86400 s, not {self.summary_period_s}")

    def in_flight_bound(self, n_stages: int) -> int:
        """Stage 0's bound on micro-batches in flight for a pipeline of ``n_stages``."""
        return self.max_in_flight if self.max_in_flight is not None else max(MIN_IN_FLIGHT, n_stages)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_tunables(pairs: list[str] | tuple[str, ...]) -> Tunables:
    """``["eval_share=1", "affinity=0", ...]`` (the CLI's ``--tune``) as Tunables; ConfigError if bad."""
    known = {f.name: f for f in fields(Tunables)}
    values: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise ConfigError(f"--tune takes KEY=VALUE with KEY one of {', '.join(known)}, not {pair!r}")
        values[key] = _parse_value(key, raw.strip())
    return replace(Tunables(), **values)  # type: ignore[arg-type]


def _parse_value(key: str, raw: str) -> object:
    try:
        if key in ("affinity", "alone_adopts"):
            return _BOOLS[raw.lower()]
        if key in ("link_delay_s", "summary_period_s"):
            return float(raw)
        if key == "max_in_flight" and raw.lower() in ("", "none", "auto"):
            return None
        return int(raw)
    except (KeyError, ValueError):
        raise ConfigError(f"--tune {key}: {raw!r} is not a valid value") from None


def tune_args(tunables: Tunables) -> list[str]:
    """The ``--tune`` flags that rebuild ``tunables`` in a child process (the demo's peers)."""
    out: list[str] = []
    for f in fields(Tunables):
        value = getattr(tunables, f.name)
        if value != f.default:
            text = "none" if value is None else (str(int(value)) if isinstance(value, bool) else str(value))
            out += ["--tune", f"{f.name}={text}"]
    return out
