"""Will DeepSpeed resume from this checkpoint at that configuration? (``ckpt check --resume-at``)

:func:`resume_check` compares what a checkpoint is (metadata only) with the DeepSpeed config and mesh a
job will load it with, and predicts what DeepSpeed 0.19.8's ``engine.load_checkpoint`` does: load it
exactly, refuse it (with DeepSpeed's own message), or load it while silently dropping state; and which
``ckpt`` command makes it load. Every rule here was checked against real loads of the test fixtures
(tests/test_resume.py runs DeepSpeed on them and compares with these predictions); a rule that was not
is said to be unchecked in its finding.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from ..deepspeed import NO_ZERO, Checkpoint, open_checkpoint
from ..deepspeed import files as fnames
from ..errors import CkptError
from ..io.jsonfile import read_json_object

REFUSED, DROPS, LOADS = "refused", "drops", "loads"
DS_DP_MESSAGE = ("ZeRORuntimeException: The checkpoint being loaded used a DP world size of {saved} but the current "
                 "world size is {now}. Automatic adjustment of ZeRO's optimizer state partitioning with a new world "
                 "size is not currently supported.")


@dataclass
class Target:
    """The configuration a job will load the checkpoint with (from its DeepSpeed config and mesh)."""

    world_size: int
    zero_stage: int
    dtype: str
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    offload_optimizer: Optional[str] = None  # "cpu", "nvme" or None
    load_universal: bool = False
    bf16_optimizer: bool = False  # bf16 with grad_accum_dtype fp32 at ZeRO-0/1: DeepSpeed's BF16_Optimizer


@dataclass
class Finding:
    """One prediction: ``verdict`` (``refused``, ``drops`` or ``note``), what happens and why, DeepSpeed's
    own message where it refuses, and the command that makes the checkpoint load."""

    verdict: str
    what: str
    deepspeed: Optional[str] = None
    fix: Optional[str] = None


@dataclass
class ResumeCheck:
    checkpoint: str
    target: Target
    findings: list = field(default_factory=list)

    @property
    def verdict(self) -> str:
        verdicts = {f.verdict for f in self.findings}
        return REFUSED if REFUSED in verdicts else DROPS if DROPS in verdicts else LOADS

    @property
    def ok(self) -> bool:
        return self.verdict == LOADS

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "target": asdict(self.target), "verdict": self.verdict,
                "findings": [asdict(f) for f in self.findings]}

    def describe(self) -> str:
        t = self.target
        head = {LOADS: "DeepSpeed loads it exactly", REFUSED: "DeepSpeed REFUSES it",
                DROPS: "DeepSpeed loads it but silently DROPS state"}[self.verdict]
        lines = [f"resume {self.checkpoint}",
                 f"    at ZeRO-{t.zero_stage} {t.dtype}, world size {t.world_size} (dp={t.dp} tp={t.tp} pp={t.pp} "
                 f"ep={t.ep} sp={t.sp})" + (f", offload_optimizer {t.offload_optimizer}" if t.offload_optimizer else "")
                 + (", load_universal" if t.load_universal else ""),
                 f"{head}"]
        for f in self.findings:
            lines.append(f"  {f.verdict.upper() if f.verdict != 'note' else 'note'}: {f.what}")
            if f.deepspeed:
                lines.append(f"    DeepSpeed says: {f.deepspeed}")
            if f.fix:
                lines.append(f"    fix: {f.fix}")
        return "\n".join(lines)


# ============================================================================================ the target
def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _known(value, what: str):
    if value == "auto":
        raise CkptError(f"the config leaves {what} 'auto': give the config the job resolves to (the HF Trainer and "
                        "Accelerate fill 'auto' in from their own arguments)")
    return value


def read_config(config: Union[dict, str, os.PathLike]) -> dict:
    """A DeepSpeed config as a dict (a dict, or a JSON file)."""
    if isinstance(config, dict):
        return config
    return read_json_object(config, "the DeepSpeed config")


def target_from_config(config: dict, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, sp: int = 1) -> Target:
    """The :class:`Target` of a DeepSpeed config at ``world_size`` ranks with the given mesh sizes."""
    if world_size < 1 or any(n < 1 for n in (tp, pp, ep, sp)) or world_size % (tp * pp * sp):
        raise CkptError(f"world size {world_size} is not a multiple of tp x pp x sp = {tp * pp * sp}")
    stage = int(_known(_get(config, "zero_optimization", "stage") or 0, "zero_optimization.stage"))
    if _known(_get(config, "bf16", "enabled") or _get(config, "bfloat16", "enabled"), "bf16.enabled"):
        dtype = "bf16"
    elif _known(_get(config, "fp16", "enabled"), "fp16.enabled"):
        dtype = "fp16"
    else:
        dtype = "fp32"
    device = _known(_get(config, "zero_optimization", "offload_optimizer", "device"), "offload_optimizer.device")
    accum = _get(config, "data_types", "grad_accum_dtype")
    return Target(world_size=world_size, zero_stage=stage, dtype=dtype, dp=world_size // (tp * pp * sp), tp=tp, pp=pp,
                  ep=ep, sp=sp, offload_optimizer=device if device in ("cpu", "nvme") else None,
                  load_universal=bool(_get(config, "checkpoint", "load_universal")),
                  bf16_optimizer=dtype == "bf16" and stage in (0, 1) and accum == "fp32")


# ============================================================================================ the rules
def _reshard(ck: Checkpoint, t: Target, universal: bool = False) -> str:
    where = ck.location.save_dir
    if universal:  # an MoE universal folder is for one expert-parallel size (docs/reshard.md)
        ep = f" --ep {t.ep}" if ck.num_experts and t.ep != ck.mesh.ep else ""
        return (f"ckpt reshard {where} OUT --universal{ep}   (then load OUT with \"checkpoint\": "
                "{\"load_universal\": true})")
    return f"ckpt reshard {where} OUT --world-size {t.dp * t.sp}   (then load OUT)"


#: DeepSpeed 0.19.8 loading a checkpoint at another tensor-parallel size (a Megatron-style mpu or the pipeline
#: grid): its Megatron state-dict loader looks for Megatron's key names in the first model file
_TP_CHANGE = "AssertionError: key: attention.dense.weight is not found in the checkpoint {file}"
#: ... at another pipeline size with ZeRO-1/2 (the module loads from the layer files; the optimizer does not)
_PP_CHANGE = ("RuntimeError: The ZeRO checkpoint parameter-alignment layout does not match the current "
              "zero_optimization.parameter_alignment setting. Load with the setting used to save the checkpoint, "
              "or disable optimizer-state loading for a module-only warm start.")


def _first_model_file(ck: Checkpoint) -> str:
    """The model file DeepSpeed's rank 0 reads first: stage 0's first layer file of tensor rank 0, else
    ``mp_rank_00_model_states.pt``."""
    names = sorted(os.listdir(ck.location.tag_dir))
    layers = [n for n in names if n.startswith("layer_") and n.endswith("-model_states.pt")
              and (n.count("-model_") == 1 or "-model_00-" in n)]
    return os.path.join(ck.location.tag_dir, layers[0] if layers else "mp_rank_00_model_states.pt")


def _mesh(ck: Checkpoint, t: Target) -> list[Finding]:
    """Checked on the 3D, pipeline and Megatron-style fixtures (tests/test_mesh_reshard.py loads them at
    another tp and pp); an expert-parallel change and AutoTP are not checked."""
    out = []
    fix = (f"ckpt reshard {ck.location.save_dir} OUT --tp {t.tp} --pp {t.pp} --ep {t.ep} --dp {t.dp}   (then load "
           "OUT at that mesh; see docs/reshard.md)")
    if ck.mesh.tp != t.tp:
        out.append(Finding(REFUSED, f"saved with tensor-parallel size {ck.mesh.tp}, loaded at {t.tp}: DeepSpeed does "
                           "not re-split the tensor ranks' files (checked with a Megatron-style mpu and the pipeline "
                           "grid; AutoTP unchecked)",
                           deepspeed=_TP_CHANGE.format(file=_first_model_file(ck)), fix=fix))
    if ck.mesh.pp != t.pp:
        checked = ck.mesh.tp == t.tp and ck.zero_stage in (1, 2) and ck.mesh.dp == t.dp
        out.append(Finding(REFUSED, f"saved with pipeline size {ck.mesh.pp}, loaded at {t.pp}: the layer files load, "
                           "the optimizer state of another stage split does not",
                           deepspeed=_PP_CHANGE if checked else None, fix=fix))
    if ck.mesh.ep != t.ep:
        out.append(Finding(REFUSED, f"saved with expert-parallel size {ck.mesh.ep}, loaded at {t.ep}: DeepSpeed reads "
                           "each expert-parallel rank's files by their own rank and does not re-split them "
                           "(unchecked)", fix=fix))
    return out


def _stage_and_dtype(ck: Checkpoint, t: Target) -> list[Finding]:
    out = []
    saved = 0 if ck.flavor == NO_ZERO else ck.zero_stage
    if t.load_universal:
        return out  # the universal loader reads another folder (see _universal)
    tag_dir = ck.location.tag_dir
    if saved != t.zero_stage and {saved, t.zero_stage} != {1, 2}:  # ZeRO-1 and 2 (and BF16_Optimizer) share files
        if 3 in (saved, t.zero_stage) and 0 not in (saved, t.zero_stage):
            msg = "AssertionError (with no message, from the ZeRO-3 / ZeRO-1/2 optimizer's load_state_dict)"
        elif saved == 0:
            msg = f"FileNotFoundError: [Errno 2] No such file or directory: '{tag_dir}/{_optim_name(t, 0)}'"
        else:
            msg = "AttributeError: 'NoneType' object has no attribute 'copy'"
        out.append(Finding(REFUSED, f"saved at ZeRO-{saved}, loaded at ZeRO-{t.zero_stage}; no ckpt command changes "
                           "the stage (DeepSpeed's universal loader refuses a stage change too: AssertionError), so "
                           "resume at the saved stage, or start a new run from `ckpt export --states all`",
                           deepspeed=msg))
    prefix = next((f.prefix for f in ck.files if f.kind == fnames.OPTIM_STATES), None)
    if prefix is not None and saved == t.zero_stage and (prefix == "bf16_") != (t.dtype == "bf16"):
        out.append(Finding(REFUSED, f"saved in {ck.dtype}, loaded in {t.dtype}: DeepSpeed names its optimizer files "
                           "with a bf16_ prefix in bf16 only, and looks for its own dtype's names",
                           deepspeed=f"FileNotFoundError: [Errno 2] No such file or directory: "
                                     f"'{tag_dir}/{_optim_name(t, 0)}'",
                           fix=_reshard(ck, t, universal=True) + "; the universal loader restores the masters, "
                               "moments and step exactly in another dtype, but not frozen parameters or buffers"))
    return out


def _optim_name(t: Target, dp: int) -> str:
    return fnames.optim_states_name(dp, 0, "bf16_" if t.dtype == "bf16" else "")


def _data_parallel(ck: Checkpoint, t: Target) -> list[Finding]:
    if ck.flavor == NO_ZERO or t.load_universal:
        return []
    saved, now = ck.partition_count, t.dp * t.sp
    if saved == now:
        return []
    frozen = [p for p in ck.parameters if not p.trainable and not p.tied_to] if ck.zero_stage == 3 else []
    what = f"saved with {saved} data-parallel partitions, loaded at {now}"
    if frozen:  # restoring the first frozen parameter's fragment fails before DeepSpeed's own check
        n = frozen[0].numel
        msg = (f"RuntimeError: The size of tensor a ({-(-n // now)}) must match the size of tensor b ({-(-n // saved)}) "
               "at non-singleton dimension 0")
    elif ck.zero_stage == 3:
        msg, what = None, what + " (DeepSpeed's message unchecked: every ZeRO-3 fixture has frozen parameters)"
    else:
        msg = DS_DP_MESSAGE.format(saved=saved, now=now)
    return [Finding(REFUSED, what, deepspeed=msg, fix=_reshard(ck, t))]


def _offload(ck: Checkpoint, t: Target) -> list[Finding]:
    swapped = bool(ck.records.index.swapped) if ck.zero_stage == 3 else False
    has_swap_dir = any(f.kind == fnames.SWAP for f in ck.files) or (ck.location.tag_dir / "offloaded_tensors").is_dir()
    out = []
    if t.offload_optimizer == "nvme":
        if t.zero_stage != 3:
            return out
        if not has_swap_dir:
            out.append(Finding(REFUSED, "an engine with offload_optimizer on nvme skips the .pt partitions and copies "
                               "<tag>/offloaded_tensors/rankNN/ into its swap folder; this checkpoint has none",
                               deepspeed="FileNotFoundError: ... offloaded_tensors/rank00",
                               fix="load it with offload_optimizer on cpu or none"))
        elif ck.partition_count != t.dp * t.sp:
            out.append(Finding(REFUSED, "an engine with offload_optimizer on nvme at another data-parallel size "
                               "fails (it would copy the swap files of its own rank, cut for the saved size)",
                               fix=_reshard(ck, t) + " with offload_optimizer on cpu or none"))
        else:
            out.append(Finding(DROPS, "an engine with offload_optimizer on nvme does not load the .pt partitions; it "
                               "copies the swap folders back, which restores at most the masters of the swapped "
                               "sub-groups (and only if it numbers the parameters as the saving engine did): the "
                               "other sub-groups' masters, every Adam moment and the step keep their fresh values "
                               "(DeepSpeed 0.19.8; the losses after resuming differ)",
                               fix=f"ckpt reshard {ck.location.save_dir} OUT --world-size {t.dp * t.sp}   (then load OUT "
                                   "with offload_optimizer on cpu or none: every partition is in the .pt files)"))
    elif swapped:
        first = min(k for _, k in ck.records.index.swapped)
        size = ck.layouts[0].sub_group_sizes[first]
        msg = (f"RuntimeError: The size of tensor a ({size}) must match the size of tensor b (0) at non-singleton "
               "dimension 0") if ck.partition_count == t.dp * t.sp else None
        out.append(Finding(REFUSED, "the checkpoint keeps swapped partitions in offloaded_tensors/ (NVMe offload) and "
                           "empty placeholders in the .pt files, which an engine without NVMe offload loads instead",
                           deepspeed=msg, fix=_reshard(ck, t)))
    return out


def _universal(ck: Checkpoint, t: Target) -> list[Finding]:
    if not t.load_universal:
        return []
    return [Finding(REFUSED, "the config sets checkpoint.load_universal, so DeepSpeed reads `latest_universal` and "
                    "a universal folder, which a ZeRO checkpoint does not have",
                    deepspeed=f"ValueError: Invalid for universal checkpoint: {ck.location.save_dir}/latest_universal "
                              "does not exist", fix=_reshard(ck, t, universal=True)),
            Finding(DROPS, "once converted, the universal loader restores neither frozen parameters nor buffers (they "
                    "keep the engine's values)" + (" and gives all ZeRO-3 sub-groups one step tensor"
                                                   if t.zero_stage == 3 else ""))]


def resume_check(checkpoint: Union[Checkpoint, str, os.PathLike], config: Union[dict, str, os.PathLike],
                 world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, sp: int = 1,
                 tag: Optional[str] = None) -> ResumeCheck:
    """Predict what DeepSpeed 0.19.8's ``load_checkpoint`` does with ``checkpoint`` in a job with DeepSpeed
    config ``config`` (a dict or JSON file) at ``world_size`` ranks and the given mesh sizes. Metadata only.
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    t = target_from_config(read_config(config), world_size, tp, pp, ep, sp)
    out = ResumeCheck(str(ck.location.tag_dir), t)
    if ck.problems:
        out.findings.append(Finding(REFUSED, "the checkpoint has problems (`ckpt inspect` lists them): "
                                    + "; ".join(ck.problems[:3])))
    for rule in (_mesh, _universal, _stage_and_dtype, _data_parallel, _offload):
        out.findings += rule(ck, t)
    return out


__all__ = ["resume_check", "ResumeCheck", "Finding", "Target", "target_from_config", "read_config",
           "REFUSED", "DROPS", "LOADS"]
