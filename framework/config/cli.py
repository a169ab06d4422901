"""Check command-line overrides before Hydra runs, so that a bad option, key or value gives one line on stderr
and exit code 2 (Hydra alone prints several lines and exits with 1)."""

from __future__ import annotations

import sys

from framework.config.load import ConfigError, compose

_HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--resolve",
                "--shell-completion", "-sc", "--run", "-r"}


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Override lists to validate: the first value of every sweep, plus each other sweep value on its own."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base, alternatives = [], []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            values = list(o.sweep_string_iterator())
            base.append(f"{key}={values[0]}" if values else o.input_line)
            alternatives += [(len(base) - 1, f"{key}={v}") for v in values[1:]]
        else:
            base.append(o.input_line)
    variants = [base]
    for index, replacement in alternatives:
        variant = list(base)
        variant[index] = replacement
        variants.append(variant)
    return variants


def precheck_overrides(argv: list[str]) -> None:
    """Compose and validate every configuration ``argv`` asks for; print one line and exit 2 on error."""
    if any(a in _HYDRA_FLAGS or a.startswith(("--config", "-cp", "-cn", "--experimental")) for a in argv):
        return  # Hydra's own flags: let Hydra handle them
    overrides = [a for a in argv if a not in ("-m", "--multirun") and not a.startswith("hydra.")
                 and not a.startswith("hydra/") and not a.startswith("+hydra")]
    try:
        for variant in expand_sweeps(overrides):
            compose(variant)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # an override Hydra cannot parse
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"config error: {first}", file=sys.stderr)
        sys.exit(2)
