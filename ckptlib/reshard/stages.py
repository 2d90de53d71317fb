"""Which layers each stage of the new pipeline holds (planning, metadata only).

The checkpoint records which stage holds each layer that has state (its layer file) and which stages hold
each tied module; it does not record the partition method, the number of layer specs, or where the layers
without state and a tied module's later uses (a ``TiedLayerSpec`` with ``forward_fn`` writes no file) are.
Every description of the model that reproduces the saved placement is a candidate (partition method
``uniform`` or ``parameters``, layer counts up to a few past the last file, at most one file-less use of a
tied module per stage; or what the user says: ``--pp-partition``, ``--pp-layers``, ``--pp-tied``), and the
new placement is trusted only when every candidate gives the same one. Otherwise the reshard is refused,
saying what to tell.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..deepspeed import Checkpoint
from ..errors import CkptError, PipelineUnknownError, UnsupportedCheckpointError
from ..layout.stages import PARAMETERS, UNIFORM, partition_balanced, partition_uniform, stage_of, validate_parts

LAYER_SLACK = 4          # layer counts tried past the last layer file
MAX_CANDIDATES = 20000   # descriptions tried before asking the user

TIED_MODULE = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")  # a tied module's parameter: (key, its name in it)


@dataclass
class PipelinePlan:
    """The new pipeline: ``target_parts`` (stage s holds layers ``[parts[s], parts[s+1])``), the stages
    holding each tied module (``tie_stages``), each layer file's stage (``layer_stage``), and how that was
    decided (``notes``)."""

    target_parts: list
    layer_stage: dict
    tie_stages: dict
    tie_order: dict          # stage -> tie keys in the order the stage registers them
    notes: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)  # the layer entries it was planned from (see plan_stages)

    def stage_names(self, layers: dict) -> dict:
        """``{stage: [model names in the stage module's order]}``: its tied modules' entries first, then
        its layers' (``layers``: :func:`~ckptlib.reshard.target.pipeline_layers`)."""
        tie_entries: dict = {}
        for idx, ents in layers.items():
            for name, _ in ents:
                m = TIED_MODULE.match(name)
                if m:
                    tie_entries.setdefault(m.group(1), []).append(name)
        out: dict = {}
        for s in range(len(self.target_parts) - 1):
            names = [n for key in self.tie_order.get(s, []) for n in tie_entries.get(key, [])]
            for idx, ents in layers.items():
                if self.layer_stage[idx] == s:
                    names += [n for n, _ in ents if not TIED_MODULE.match(n)]
            out[s] = names
        return out


def _refuse(ck: Checkpoint, why: str, hint: str) -> None:
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


def _ask(ck: Checkpoint, why: str) -> None:
    """Refuse because the user must say how the PipelineModule places its layers (its default hint says how)."""
    raise PipelineUnknownError(why, path=ck.location.tag_dir)


def parse_partition(text: Optional[str]) -> tuple[Optional[str], Optional[list]]:
    """``--pp-partition``: ``"uniform"``, ``"parameters"`` or boundaries ``"0,4,7"``."""
    if text is None:
        return None, None
    t = text.strip().lower()
    if t in (UNIFORM, PARAMETERS):
        return t, None
    try:
        return None, [int(x) for x in t.split(",")]
    except ValueError:
        raise CkptError(f"--pp-partition {text!r}: give uniform, parameters or the stage boundaries, e.g. 0,4,7") from None


def parse_tied(items: Sequence[str]) -> dict:
    """``--pp-tied KEY:I,J``: every layer index that uses the tied module ``KEY``, in the order given (the first:
    the layer whose file holds it, which a universal folder does not record)."""
    out = {}
    for item in items or ():
        key, _, uses = item.partition(":")
        try:
            listed = [int(x) for x in uses.split(",") if x.strip()]
        except ValueError:
            raise CkptError(f"--pp-tied {item!r}: give KEY:LAYER,LAYER (e.g. embed:0,6)") from None
        out[key.strip()] = list(dict.fromkeys(listed))
        if not key.strip() or not out[key.strip()]:
            raise CkptError(f"--pp-tied {item!r}: give KEY:LAYER,LAYER (e.g. embed:0,6)")
    return out


@dataclass
class StageFacts:
    """What the source says about its pipeline: the layers with a file (``layers``), each one's source stage
    (``stage_of_layer``; None: not recorded, a universal folder's tied module), the layer whose file holds each
    tied module (``file_of_tie``), the source stages holding each tied module (``holders``), its stage count."""

    layers: list
    stage_of_layer: dict
    file_of_tie: dict
    holders: dict
    pp: int


def ties_in(layers: dict) -> dict:
    """``{tie key: the layer whose file holds it}`` of the layer entries ``layers``."""
    out: dict = {}
    for idx, ents in layers.items():
        for name, _ in ents:
            m = TIED_MODULE.match(name)
            if m:
                out.setdefault(m.group(1), idx)
    return out


def source_facts(ck: Checkpoint, layers: dict) -> StageFacts:
    """The :class:`StageFacts` of a native pipeline checkpoint: its layer files and each stage's parameters."""
    by_path = dict(ck.layer_stages.items())
    stage_of_layer = {}
    for f in ck.files:
        if f.kind == "layer_states" and (f.mp_rank or 0) == 0 and f.layer in layers:
            stage_of_layer[f.layer] = by_path.get(str(f.path), by_path.get(f.path.as_posix(), -1)) \
                if layers[f.layer] else None  # a layer without state: no stage lists it
    holders: dict = {}
    for zs in ck.sets.values():
        for p in zs.parameters:
            m = TIED_MODULE.match(p.name)
            if m:
                holders.setdefault(m.group(1), set()).add(zs.coordinate.pp)
    return StageFacts(layers=sorted(layers), stage_of_layer=stage_of_layer, file_of_tie=ties_in(layers),
                      holders=holders, pp=ck.mesh.pp)


def _weights(num_layers: int, uses: dict, layer_weight: dict, tie_weight: dict) -> list:
    w = [0] * num_layers
    for idx, x in layer_weight.items():
        w[idx] = x
    for key, positions in uses.items():
        for i in positions:
            w[i] = tie_weight[key]
    return w


def _placement(parts: list, facts: StageFacts, uses: dict) -> Optional[tuple]:
    try:
        by_layer = tuple(stage_of(parts, i) for i in facts.layers)
        ties = {}
        order: dict = {}
        for key, positions in sorted(uses.items()):
            stages = sorted({stage_of(parts, i) for i in positions})
            ties[key] = tuple(stages)
            for s in stages:
                first = min(i for i in positions if stage_of(parts, i) == s)
                order.setdefault(s, []).append((first, key))
    except ValueError:
        return None
    return by_layer, tuple(sorted(ties.items())), tuple(sorted((s, tuple(k for _, k in sorted(v)))
                                                               for s, v in order.items()))


def plan_stages(ck: Checkpoint, layers: dict, target_pp: int, source_weights: dict, target_weights: dict,
                tie_source_weight: dict, tie_target_weight: dict, *, partition: Optional[str] = None,
                num_layers: Optional[int] = None, tied: Optional[dict] = None,
                facts: Optional[StageFacts] = None) -> PipelinePlan:
    """The new pipeline of ``ck`` at ``target_pp`` stages (see the module docstring). ``layers``: the
    layer files' entries; ``*_weights``: each layer file's trainable parameters at the source's and the
    target's tensor size (``tie_*_weight``: a tied module's, which each of its uses counts); ``facts``: what the
    source says of its stages (default: its layer files', :func:`source_facts`)."""
    facts = facts if facts is not None else source_facts(ck, layers)
    if target_pp > len(facts.layers):
        _refuse(ck, f"more stages ({target_pp}) than layers with parameters ({len(facts.layers)}): a stage would hold "
                    "nothing to train", "pick at most as many stages as layers")
    method, explicit = parse_partition(partition)
    tied = {k: sorted(set(v)) for k, v in (tied or {}).items()}
    unknown = sorted(set(tied) - set(facts.file_of_tie))
    if unknown:
        _ask(ck, f"--pp-tied names {', '.join(unknown)}, but no layer file holds a tied module of that key "
                 f"(known: {', '.join(sorted(facts.file_of_tie)) or 'none'})")
    for key, positions in tied.items():
        if facts.file_of_tie[key] not in positions:
            _ask(ck, f"--pp-tied {key}: layer {facts.file_of_tie[key]} holds its file, so it is one of its uses")
    last = max(facts.layers + [i for ps in tied.values() for i in ps] + [-1])
    if explicit is not None:
        why = validate_parts(explicit, target_pp, last + 1)
        if why:
            _ask(ck, f"--pp-partition: {why}")
        lengths = [explicit[-1]]
    elif num_layers is not None:
        if num_layers <= last:
            _ask(ck, f"--pp-layers {num_layers}: the checkpoint has layers up to {last}")
        lengths = [num_layers]
    else:
        lengths = list(range(last + 1, last + 2 + LAYER_SLACK))
    methods = [method] if method else [UNIFORM, PARAMETERS]
    if explicit is not None:
        methods = ["explicit"]
    found: dict = {}
    tried = 0
    for n in lengths:
        occupied = set(facts.layers)
        free = [i for i in range(n) if i not in occupied]
        for uses in _use_choices(facts, tied, free):
            tried += 1
            if tried > MAX_CANDIDATES:
                _ask(ck, "too many descriptions of the pipeline fit the checkpoint to try them all")
            for m in methods:
                if m != "explicit" and facts.pp > 1:  # the source's own placement must come out again
                    src = _parts(m, n, facts.pp, _weights(n, uses, source_weights, tie_source_weight))
                    if src is None or not _reproduces(src, facts, uses):
                        continue
                parts = explicit if m == "explicit" else _parts(m, n, target_pp,
                                                                _weights(n, uses, target_weights, tie_target_weight))
                if parts is None or (m != "explicit" and parts[-1] != n):
                    continue
                got = _placement(parts, facts, uses)
                if got is not None:
                    found.setdefault(got, (parts, m, n, uses))
    if not found:
        _ask(ck, f"no description of the pipeline reproduces where its {facts.pp} stage(s) keep their layers "
                 "and tied modules")
    if len(found) > 1:
        alts = list(found.values())[:3]
        say = "; ".join(f"{m} over {n} layers{_uses_text(u)} gives stages {p}" for p, m, n, u in alts)
        _ask(ck, f"the checkpoint fits several pipelines that would place layers differently at {target_pp} "
                 f"stage(s) ({say})")
    (by_layer, ties, order), (parts, m, n, uses) = next(iter(found.items()))
    notes = [f"new pipeline: {target_pp} stage(s), boundaries {parts}"
             + ("" if m == "explicit" else f" (every description that reproduces the source's {facts.pp} stage(s) "
                                           f"gives this placement; e.g. partition_method {m!r} over {n} layer specs)")]
    return PipelinePlan(target_parts=list(parts), layer_stage=dict(zip(facts.layers, by_layer)),
                        tie_stages={k: list(v) for k, v in ties}, tie_order={s: list(v) for s, v in order},
                        notes=notes, layers=layers)


def _uses_text(uses: dict) -> str:
    return "".join(f", {k} used by layers {sorted(v)}" for k, v in sorted(uses.items()))


def _parts(method: str, n: int, pp: int, weights: list) -> Optional[list]:
    if method == UNIFORM:
        return partition_uniform(n, pp)
    if method == PARAMETERS:
        return partition_balanced(weights, pp)
    return None


def _reproduces(parts: list, facts: StageFacts, uses: dict) -> bool:
    for idx in facts.layers:
        want = facts.stage_of_layer.get(idx, -1)
        if want is not None and stage_of(parts, idx) != want:  # None: not recorded (its tie's holders say)
            return False
    for key, holders in facts.holders.items():
        if {stage_of(parts, i) for i in uses.get(key, [facts.file_of_tie.get(key)]) if i is not None} != holders:
            return False
    return True


def _use_choices(facts: StageFacts, tied: dict, free: list):
    """Every assignment of each tie's uses: the given ones, or its file's layer plus at most one file-less
    use per source stage (any free slot)."""
    keys = sorted(facts.file_of_tie)
    options = []
    for key in keys:
        if key in tied:
            options.append([tuple(tied[key])])
            continue
        base = facts.file_of_tie[key]
        extra = [()] + [(i,) for i in free]
        if facts.pp > 1:  # a second file-less use only where a further stage needs one
            extra += [c for c in itertools.combinations(free, 2)]
        options.append([tuple(sorted({base, *e})) for e in extra])
    for combo in itertools.product(*options):
        positions = [i for ps in combo for i in ps]
        if len(positions) != len(set(positions)):
            continue
        yield dict(zip(keys, combo))


__all__ = ["TIED_MODULE", "PipelinePlan", "StageFacts", "source_facts", "ties_in", "plan_stages", "parse_partition", "parse_tied", "LAYER_SLACK"]
