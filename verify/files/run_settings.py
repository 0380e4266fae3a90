"""What a run is checked against: the variant of attention, field by field, from the command line,
the input case and run.toml, and the mismatches where run.toml says the run computed something
else than the input case asks for (verify/files/outputs.py opens the run with these)."""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..stages import INPUT_MANIFEST, RUN_MANIFEST
from ..variant import Variant
from .case import InputCase
from .manifests import build_variant, variant_fields
from .variant_inputs import COVERAGE_FIELD

# The option of `attnstep check` that says each setting (a mismatch's hint names it).
CHECK_OPTIONS = {"causal": "--causal/--no-causal", "scale": "--scale", "align": "--align", "window": "--window",
                 "softcap": "--softcap", "alibi": "--alibi/--no-alibi", "dropout": "--dropout"}


@dataclass(frozen=True)
class Mismatch:
    """run.toml says the run computed `key` = run_value, the input case asks for input_value."""
    key: str
    run_value: object
    input_value: object

    def message(self) -> str:
        def show(v):
            if isinstance(v, bool):
                return str(v).lower()
            if isinstance(v, tuple):
                return ",".join(map(str, v))
            return v if isinstance(v, str) else f"{float(v):.9g}"
        option = CHECK_OPTIONS.get(self.key)
        hint = f"run again, or pass {option} to check what it computed" if option else "run it again on this case"
        return (f"the run computed {self.key} = {show(self.run_value)} (run.toml) but the input case "
                f"asks for {self.key} = {show(self.input_value)}; HINT: {hint}")


# A variant field on which run.toml and the input case may differ: the check never draws the
# dropout mask again (it reads the program's), so the seed cannot make a stage wrong.
_NOT_COMPARED = ("dropout_seed",)
_VARIANT_FIELDS = tuple(f.name for f in dataclass_fields(Variant))


def _same(a, b) -> bool:
    """Equal as the binary holds them (floats in float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))
    return a == b


def _asked_variant(case: InputCase) -> Dict[str, object]:
    """The Variant fields the input case says: all of them with a manifest (a key left out is the
    default), else the mask and bias that its files hold."""
    if case.manifest:
        return {name: getattr(case.variant, name) for name in _VARIANT_FIELDS}
    return {name: getattr(case.variant, name) for name in COVERAGE_FIELD.values()}


def resolve_variant(case: InputCase, values: dict, said: Mapping[str, object], folder: Optional[Path]
                    ) -> Tuple[Variant, List[Mismatch]]:
    """The variant a run is checked against, each field from the command line (`said`), else the
    input case, else run.toml (`values`, in `folder`), else the default; and a mismatch for each
    field where run.toml disagrees with an input case that says."""
    asked, ran = _asked_variant(case), variant_fields(values)
    case_place = case.path / INPUT_MANIFEST if case.manifest else case.path
    sources = (("the command line", said), (str(case_place), asked), (str(Path(folder or ".") / RUN_MANIFEST), ran))
    mismatches = []
    fields, origin = {}, {}
    for name in _VARIANT_FIELDS:
        for where, source in sources:
            if name in source:
                fields[name], origin[name] = source[name], where
                break
        if name not in said and name in asked and name in ran and name not in _NOT_COMPARED \
                and not _same(ran[name], asked[name]):
            mismatches.append(Mismatch(name, ran[name], asked[name]))
    return build_variant(fields, lambda name: origin.get(name, "the defaults")), mismatches
