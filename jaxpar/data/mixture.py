"""A mixture file (data.mixture=FILE.yaml): prepared folders with weights, and phases
that change the weights from a step on:

    sources:
      web: {path: data/web, weight: 0.7}
      code: {path: data/code, weight: 0.3}
    phases:
      - {from_step: 9000, weights: {web: 0.3, code: 0.7}}

Weights are refused unless they sum to 1 (within 1e-6): a mistyped weight is not
silently rescaled. A phase names every source it weighs; one it leaves out gets 0.
Paths are read relative to the file's folder. Every source must be a folder that
`jaxpar prepare-data` wrote with the same tokenizer (meta.json's vocab_size and
tokenizer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxpar.data.tokens import META, meta_of
from jaxpar.errors import ConfigError

SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Phase:
    from_step: int
    weights: dict[str, float]  # every source's, 0 where the phase leaves it out


@dataclass(frozen=True)
class Mixture:
    paths: dict[str, Path]  # source -> its prepared folder
    phases: tuple[Phase, ...]  # the first from step 0: the sources' own weights

    def weights_at(self, step: int) -> dict[str, float]:
        return [p for p in self.phases if p.from_step <= step][-1].weights


def describe(file: str, steps: int) -> str:
    """A mixture in words, for the start-up summary: its weights, and each phase's."""
    mix = read(file)

    def weights(p: Phase) -> str:
        return ", ".join(f"{n} {w:g}" for n, w in p.weights.items())

    later = [
        f"from step {p.from_step}: {weights(p)}" for p in mix.phases[1:] if p.from_step < steps
    ]
    return f"mixture: {file}, in epochs ({'; '.join([weights(mix.phases[0]), *later])})"


def read(file: str) -> Mixture:
    """The mixture `file` describes, checked (ConfigError names the key and the fix)."""
    where = f"data.mixture={file}"
    try:
        spec = yaml.safe_load(Path(file).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(
            f"{where}: cannot read it ({_first(e)}); give a YAML mixture file"
        ) from None
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("sources"), dict)
        or not spec["sources"]
    ):
        raise ConfigError(
            f"{where}: no `sources:` mapping; the file lists sources: {{name: {{path, weight}}}}"
        )
    unknown = set(spec) - {"sources", "phases"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {sorted(unknown)[0]!r}; a mixture has sources: and phases:"
        )
    home = Path(file).parent
    paths, weights = {}, {}
    for name, source in spec["sources"].items():
        if not isinstance(source, dict) or set(source) != {"path", "weight"}:
            raise ConfigError(
                f"{where}: source {name!r} must be {{path: FOLDER, weight: W}}, got {source!r}"
            )
        paths[str(name)] = _folder(where, str(name), home / str(source["path"]))
        weights[str(name)] = source["weight"]
    phases = [Phase(0, _weights(where, "sources", weights, paths))]
    for i, phase in enumerate(spec.get("phases") or []):
        phases.append(_phase(where, i + 1, phase, paths, phases[-1].from_step))
    _same_tokenizer(where, paths)
    return Mixture(paths, tuple(phases))


def _phase(where: str, i: int, phase, paths: dict, after: int) -> Phase:
    if not isinstance(phase, dict) or set(phase) != {"from_step", "weights"}:
        raise ConfigError(
            f"{where}: phase {i} must be {{from_step: N, weights: {{...}}}}, got {phase!r}"
        )
    step = phase["from_step"]
    if not isinstance(step, int) or isinstance(step, bool) or step <= after:
        raise ConfigError(
            f"{where}: phase {i} has from_step={step!r}, not after {after} (the step the weights "
            "before it start at); list phases in the order of their steps, each from_step a "
            "whole number larger than the one before"
        )
    if not isinstance(phase["weights"], dict):
        raise ConfigError(f"{where}: phase {i}'s weights must be a mapping {{source: weight}}")
    named = {str(k): v for k, v in phase["weights"].items()}
    return Phase(
        step, _weights(where, f"phase {i}", {k: named.get(k, 0) for k in paths} | named, paths)
    )


def _weights(where: str, what: str, weights: dict, paths: dict) -> dict[str, float]:
    for name, w in weights.items():
        if name not in paths:
            raise ConfigError(
                f"{where}: {what} weighs {name!r}, which is not a source "
                f"(sources: {', '.join(paths)})"
            )
        if isinstance(w, bool) or not isinstance(w, int | float) or not (0 <= w <= 1):
            raise ConfigError(
                f"{where}: {what} gives {name!r} weight {w!r}; a weight is a number from 0 to 1"
            )
    total = math.fsum(weights.values())
    if abs(total - 1) > SUM_TOLERANCE:
        scaled = ", ".join(f"{k}: {w / total:.4g}" for k, w in weights.items()) if total else "-"
        raise ConfigError(
            f"{where}: {what}'s weights sum to {total:.6g}, not 1; they are not rescaled for "
            f"you: give weights that sum to 1 (rescaled, these are {{{scaled}}})"
        )
    return {k: float(w) for k, w in weights.items()}


def _folder(where: str, name: str, path: Path) -> Path:
    if not (path / META).is_file():
        what = "no such folder" if not path.exists() else f"no {META} in it"
        raise ConfigError(
            f"{where}: source {name!r} has path {path}: {what}; give a folder `jaxpar "
            "prepare-data` wrote (paths are read relative to the mixture file)"
        )
    return path


def _same_tokenizer(where: str, paths: dict[str, Path]) -> None:
    metas = {name: meta_of(path) for name, path in paths.items()}
    first, *rest = metas
    for name in rest:
        for key in ("vocab_size", "tokenizer"):
            if metas[name].get(key) != metas[first].get(key):
                raise ConfigError(
                    f"{where}: sources {first!r} and {name!r} were prepared with different "
                    f"vocabularies ({key} {metas[first].get(key)!r} and {metas[name].get(key)!r}); "
                    "prepare every source with the same tokenizer"
                )


def _first(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
