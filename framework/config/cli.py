"""Check command-line overrides before Hydra runs, so that a bad option, key or value gives one line on stderr
and exit code 2 (Hydra alone prints several lines and exits with 1).

A multirun sweep is checked combination by combination (its full cross product, the jobs Hydra's basic sweeper
will launch), so that a bad pairing such as ``speculative=none,ngram speculative.num_steps=4,0`` is refused
before the first job runs rather than ending the sweep half way."""

from __future__ import annotations

import itertools
import math
import sys

from framework.config.load import ConfigError, compose

_HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--resolve",
                "--shell-completion", "-sc", "--run", "-r"}

# NOTE: composing one configuration takes ~0.15 s; above this many combinations only the first value of every
# sweep plus each other value on its own is checked (a pairing of two non-first values can then slip through
# and fail in its own job, which the sweep reports without stopping).
MAX_CHECKED_COMBINATIONS = 64


def sweep_choices(overrides: list[str]) -> list[list[str]]:
    """Per override key, the ``key=value`` strings it expands to (one for a plain override), in Hydra's order.

    A key given twice keeps its first position and its last value, as Hydra's basic sweeper does."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override():
            choices[key] = [f"{key}={v}" for v in o.sweep_string_iterator()] or [o.input_line]
        else:
            choices[key] = [o.input_line]
    return list(choices.values())


def expand_sweeps(overrides: list[str], limit: int = MAX_CHECKED_COMBINATIONS) -> list[list[str]]:
    """Override lists to validate: every combination of the sweep values when there are at most ``limit`` of
    them, else the first value of every sweep plus each other sweep value on its own."""
    choices = sweep_choices(overrides)
    if math.prod(len(c) for c in choices) <= limit:
        return [list(combination) for combination in itertools.product(*choices)]
    base = [c[0] for c in choices]
    variants = [base]
    for index, values in enumerate(choices):
        for value in values[1:]:
            variant = list(base)
            variant[index] = value
            variants.append(variant)
    return variants


def precheck_overrides(argv: list[str]) -> None:
    """Compose and validate every configuration ``argv`` asks for; print one line and exit 2 on error."""
    if any(a in _HYDRA_FLAGS or a.startswith(("--config", "-cp", "-cn", "--experimental")) for a in argv):
        return  # Hydra's own flags: let Hydra handle them
    overrides = [a for a in argv if a not in ("-m", "--multirun") and not a.startswith("hydra.")
                 and not a.startswith("hydra/") and not a.startswith("+hydra")]
    try:
        swept = {value for values in sweep_choices(overrides) if len(values) > 1 for value in values}
        for variant in expand_sweeps(overrides):
            try:
                compose(variant)
            except ConfigError as err:
                if not swept:
                    raise
                combination = " ".join(v for v in variant if v in swept)
                raise ConfigError(f"{err} (in the sweep combination {combination})") from None
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # an override Hydra cannot parse
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"config error: {first}", file=sys.stderr)
        sys.exit(2)
