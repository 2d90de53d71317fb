"""peft adapters (issue 31): the vocabulary (ckptlib/kinds/adapters.py) on the real Trainer + DeepSpeed runs of
tests/fixtures/peft, inspect, and ``export --adapter`` loaded by peft itself."""
from __future__ import annotations

import json

import pytest

from ckptlib.errors import CkptError
from ckptlib.kinds import adapters as A

torch = pytest.importorskip("torch")


def _reference(fx):
    return torch.load(fx["reference_paths"][-1], weights_only=False)


def _adapter_only(peft_names) -> set:
    """peft's saved names without the base embedding peft adds for a targeted embedding (save_embedding_layers)."""
    return {n for n in peft_names if not n.endswith(".base_layer.weight")}


def _config(fx):
    return A.parse_config(json.loads((fx["checkpoint_path"] / A.CONFIG_FILE).read_text()))


def test_names_map_as_peft_saves_them(peft_fixtures):
    """Every fixture: the mapping of the PeftModel's (DeepSpeed's) names is peft's own get_peft_model_state_dict's."""
    assert len(peft_fixtures) == 19
    for fx in peft_fixtures.values():
        ref = _reference(fx)
        mapping = A.adapter_names(ref["fp32"], _config(fx))
        assert {s for _, s in mapping.values()} == _adapter_only(ref["peft_fp32"]), fx["name"]
        for name, (_, saved) in mapping.items():
            assert torch.equal(ref["fp32"][name], ref["peft_fp32"][saved]), (fx["name"], name)
        assert A.looks_like_adapter(ref["fp32"]) and not A.looks_like_adapter(ref["frozen"])
    emb = A.counts(A.adapter_names(_reference(peft_fixtures["peft_lora_emb_z3"])["fp32"]))
    assert emb == {A.LORA_A: 2, A.LORA_B: 2, A.EMB_A: 1, A.EMB_B: 1}


def test_config_methods(peft_fixtures):
    methods = {fx["method"]: _config(fx) for fx in peft_fixtures.values()}
    assert methods["lora-qv"].describe() == "LoRA r=4 alpha=8 (scaling 2) on q_proj, v_proj"
    assert methods["lora-all"].method == "rsLoRA" and methods["lora-all"].modules_to_save == ("lm_head",)
    assert abs(methods["lora-all"].scaling - 16 / 8 ** 0.5) < 1e-12
    assert methods["dora"].method == "DoRA" and methods["dora"].use_dora


def test_saved_names_of_every_kind():
    p = "base_model.model.model."
    assert A.split(p + "embed_tokens.lora_embedding_A.default") == (A.EMB_A, "default", p + "embed_tokens.lora_embedding_A")
    assert A.split(p + "layers.0.q_proj.lora_B.default.bias") == (A.LORA_B, "default", p + "layers.0.q_proj.lora_B.bias")
    assert A.split(p + "layers.0.q_proj.lora_magnitude_vector.default.weight")[2] == \
        p + "layers.0.q_proj.lora_magnitude_vector"
    assert A.split("base_model.model.score.modules_to_save.default.weight") == \
        (A.MODULES_TO_SAVE, "default", "base_model.model.score.weight")
    assert A.split("base_model.model.score.original_module.weight") is None
    assert A.split(p + "layers.0.q_proj.base_layer.weight") is None
    cfg = A.parse_config({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "all"})
    assert A.saved_name(p + "layers.0.q_proj.base_layer.bias", cfg) == (A.BIAS, p + "layers.0.q_proj.base_layer.bias")


def test_refusals_say_why():
    with pytest.raises(CkptError, match="IA3.*LoRA adapters only"):
        A.parse_config({"peft_type": "IA3"})
    with pytest.raises(CkptError, match="layer_replication"):
        A.parse_config({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "layer_replication": [[0, 1]]})
    with pytest.raises(CkptError, match="no adapter tensor peft saves"):
        A.saved_name("base_model.model.model.norm.weight", A.parse_config({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    with pytest.raises(CkptError, match="2 adapters"):
        A.adapter_names(["base_model.model.q.lora_A.default.weight", "base_model.model.q.lora_A.other.weight"])


# ------------------------------------------------------------------------------------------------ inspect
def _copy(fx, tmp_path):
    import shutil

    dst = tmp_path / "checkpoint-4"
    shutil.copytree(fx["checkpoint_path"], dst)
    return dst


def _inspect(path):
    import ckptlib
    from ckptlib.analysis.summary import describe, format_text

    ck = ckptlib.open_checkpoint(path)
    return describe(ck), format_text(ck)


def test_inspect_names_the_adapter_and_the_16bit_file(peft_fixtures):
    """Every fixture: method, r, alpha, targets, modules_to_save, counts, base weights not in the checkpoint; the
    Trainer's (transformers 5.24) adapter file is the 16-bit copy of the masters."""
    for fx in peft_fixtures.values():
        d, text = _inspect(fx["checkpoint_path"])
        a = d["adapter"]
        cfg = fx and _config(fx)
        assert (a["method"], a["r"], a["alpha"]) == (cfg.method, cfg.r, cfg.alpha), fx["name"]
        assert a["modules_to_save"] == (["lm_head"] if fx["method"] == "lora-all" else [])
        assert a["tensors"] == len(_reference(fx)["fp32"]) and not a["base_in_checkpoint"]
        assert a["weights_file"]["status"] == "16-bit copy of the masters", (fx["name"], a["weights_file"])
        if fx["method"] in ("lora-emb", "dora-emb") and fx["zero_stage"] == 2:  # ZeRO-3: peft gets no frozen weight
            assert "base weights peft saves for a targeted embedding" in a["weights_file"]["detail"]
        assert f"adapter     peft {cfg.method}: r={cfg.r}" in text and "16-BIT COPY OF THE MASTERS" in text
        assert "base weights: not in the checkpoint" in text


def test_inspect_flags_an_empty_or_different_adapter_file(peft_fixtures, tmp_path):
    """The empty file of transformers 4.x at ZeRO-3 (no tensor; or 0-element tensors, a script's save_pretrained),
    an fp32 file equal to the masters, and one that differs, are each reported for what they are; the file is read
    as safetensors."""
    from safetensors.torch import save_file

    fx = peft_fixtures["peft_lora_qv_z3_nogather"]
    ck = _copy(fx, tmp_path)
    ref = _reference(fx)
    target = ck / A.WEIGHTS_FILE
    save_file({}, target, metadata={"format": "pt"})
    assert target.stat().st_size <= 48
    d, text = _inspect(ck)
    assert d["adapter"]["weights_file"]["status"] == "empty" and "EMPTY; no tensor" in text
    save_file({k: torch.empty(0, dtype=torch.bfloat16) for k in ref["peft_fp32"]}, target)
    assert _inspect(ck)[0]["adapter"]["weights_file"]["status"] == "empty"
    save_file(ref["peft_fp32"], target)
    assert _inspect(ck)[0]["adapter"]["weights_file"]["status"] == "the fp32 masters"
    changed = dict(ref["peft_fp32"])
    first = sorted(changed)[0]
    changed[first] = changed[first] + 1
    save_file(changed, target)
    f = _inspect(ck)[0]["adapter"]["weights_file"]
    assert f["status"] == "different" and first in f["detail"]


# ------------------------------------------------------------------------------------------------ export --adapter
def _load_peft(base_path, adapter_path):
    """PeftModel.from_pretrained(base, adapter) with every warning and log record of the load caught."""
    import logging
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(base, adapter_path)
    finally:
        logging.getLogger().removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    return model, [s for s in said if "key" in s.lower()]


def test_export_adapter_loads_in_peft_bit_equal_to_the_live_masters(peft_fixtures, tmp_path):
    """Acceptance (issue 31): every fixture, checkpoints at steps 2 and 4; chosen by default (and said); peft loads
    the export with no key warning, and every trainable tensor of the loaded PeftModel is the live engine's fp32
    master, bit for bit."""
    pytest.importorskip("peft")
    import ckptlib
    from safetensors import safe_open

    for fx in peft_fixtures.values():
        for ckpt, ref_path in zip(fx["checkpoint_paths"], fx["reference_paths"]):
            out = tmp_path / f"{fx['name']}-{ckpt.name}"
            plan = ckptlib.plan_export(ckpt, out)
            assert any("trains a peft adapter: exported as one" in n for n in plan.notes)
            ckptlib.export(plan)
            ref = torch.load(ref_path, weights_only=False)
            with safe_open(out / A.WEIGHTS_FILE, "pt") as f:
                assert set(f.keys()) == _adapter_only(ref["peft_fp32"])
                for k in f.keys():
                    assert torch.equal(f.get_tensor(k), ref["peft_fp32"][k]), (fx["name"], k)
            model, complaints = _load_peft(fx["base_path"], out)
            assert not complaints, (fx["name"], complaints)
            loaded = {n: p for n, p in model.named_parameters() if n in ref["fp32"]}
            assert set(loaded) == set(ref["fp32"]), fx["name"]
            for n, p in loaded.items():
                assert p.dtype == torch.float32 and torch.equal(p.detach(), ref["fp32"][n]), (fx["name"], n)


def test_export_adapter_options(peft_fixtures, tmp_path):
    """--dtype bf16 is the Trainer's 16-bit file bit for bit; --states under the same names; the config given;
    the side files copied; --no-adapter says why a copied config.json is no fix."""
    import ckptlib
    from safetensors import safe_open

    fx = peft_fixtures["peft_dora_z3"]
    ckpt = fx["checkpoint_path"]
    ckptlib.export(ckpt, tmp_path / "bf16", dtype="bf16", states=["exp_avg"])
    ref = _reference(fx)
    mapping = A.adapter_names(ref["fp32"])
    with safe_open(tmp_path / "bf16" / A.WEIGHTS_FILE, "pt") as mine, safe_open(ckpt / A.WEIGHTS_FILE, "pt") as theirs:
        assert sorted(mine.keys()) == sorted(theirs.keys())
        assert all(torch.equal(mine.get_tensor(k), theirs.get_tensor(k)) for k in mine.keys())
    with safe_open(tmp_path / "bf16" / "exp_avg" / A.WEIGHTS_FILE, "pt") as f:
        assert f.metadata()["optimizer_state"] == "exp_avg"
        for n, (_, s) in mapping.items():
            assert torch.equal(f.get_tensor(s), ref["exp_avg"][n]), n
    assert {"adapter_config.json", "README.md", "tokenizer.json"} <= {p.name for p in (tmp_path / "bf16").iterdir()}
    plan = ckptlib.plan_export(ckpt, tmp_path / "plain", adapter=False)
    assert any("with a copied config.json it would build a randomly initialised model" in n for n in plan.notes)
    assert not any("copy the config.json" in n for n in plan.notes)
    assert all(t.name == t.source for t in plan.tensors)


def test_export_adapter_refusals(peft_fixtures, ds_fixtures, tmp_path):
    import shutil

    import ckptlib

    fx = peft_fixtures["peft_lora_qv_z2"]
    ck = _copy(fx, tmp_path)
    cfg = json.loads((ck / A.CONFIG_FILE).read_text())
    (ck / A.CONFIG_FILE).unlink()
    with pytest.raises(CkptError, match="no adapter_config.json is beside the tag") as e:
        ckptlib.plan_export(ck, tmp_path / "o1")
    assert "--adapter-config" in e.value.hint
    given = tmp_path / "given.json"
    given.write_text(json.dumps(cfg))
    ckptlib.export(ck, tmp_path / "o2", adapter_config=given)
    assert json.loads((tmp_path / "o2" / A.CONFIG_FILE).read_text()) == cfg
    (ck / A.CONFIG_FILE).write_text(json.dumps(dict(cfg, peft_type="LOHA")))
    with pytest.raises(CkptError, match="LOHA keeps tensors ckptlib has not checked"):
        ckptlib.plan_export(ck, tmp_path / "o3")
    assert ckptlib.plan_export(ck, tmp_path / "o3", adapter=False).tensors  # the full-model layout still works
    with pytest.raises(CkptError, match="in safetensors"):
        ckptlib.plan_export(ck, tmp_path / "o4", adapter=True, format="torch")
    plain = next(iter(ds_fixtures.values()))["checkpoint_path"]
    with pytest.raises(CkptError, match="trains no peft adapter"):
        ckptlib.plan_export(plain, tmp_path / "o5", adapter=True)
    shutil.rmtree(ck)


# ------------------------------------------------------------------------------------------------ diff
def test_diff_pairs_deepspeed_names_with_peft_names(peft_fixtures, tmp_path):
    """ckpt diff CKPT ADAPTER: the checkpoint's names paired with peft's; against the --adapter export every tensor
    and state is the same; against the Trainer's 16-bit file every name pairs and the note says what it is; an
    empty adapter file is called empty."""
    import ckptlib
    from safetensors.torch import save_file

    from ckptlib.analysis.tensordiff import diff, plan_diff

    for name in ("peft_lora_all_z3_nogather", "peft_dora_z2"):
        fx = peft_fixtures[name]
        ckpt = fx["checkpoint_path"]
        out = tmp_path / name
        ckptlib.export(ckpt, out, states=["all"])
        result = diff(ckpt, out, states=True)
        assert result.tensors and all(t.status == "same" for t in result.tensors), name
        assert len(result.tensors) == 3 * len(_reference(fx)["fp32"]) + len(result.plan.steps)
        plan = plan_diff(ckpt, ckpt / A.WEIGHTS_FILE)
        assert all(i.comparable for i in plan.items), name
        assert any("paired with peft's saved names" in n for n in plan.notes)
        assert any("B holds 16-bit copies" in n for n in plan.notes)
    empty = tmp_path / "empty.safetensors"
    save_file({}, empty)
    plan = plan_diff(peft_fixtures["peft_lora_qv_z3"]["checkpoint_path"], empty)
    assert any("B is an empty adapter file" in n for n in plan.notes)


def test_diff_against_an_adapter_folder(peft_fixtures, tmp_path):
    """ckpt diff CKPT FOLDER, FOLDER holding adapter_model.safetensors: a folder as peft's save_pretrained (and the
    Trainer's save_model) leave it pairs every name; ``ckpt diff checkpoint-N checkpoint-N/`` (the Trainer's folder
    holds the tag and peft's file) compares the masters with that file, not the checkpoint with itself, and says so:
    the 16-bit copy differs by its rounding; an empty one leaves every tensor only in A."""
    import shutil

    from safetensors.torch import save_file

    from ckptlib.analysis.tensordiff import diff

    fx = peft_fixtures["peft_lora_all_z3_nogather"]
    ckpt = fx["checkpoint_path"]
    n = len(_reference(fx)["fp32"])
    folder = tmp_path / "final"
    folder.mkdir()
    for f in (A.WEIGHTS_FILE, A.CONFIG_FILE):
        shutil.copyfile(ckpt / f, folder / f)
    for b in (folder, ckpt, ckpt / fx["tags"][-1]):
        result = diff(ckpt, b)
        statuses = [t.status for t in result.tensors]
        assert len(statuses) == n and statuses.count("changed") == n, (b, statuses)  # bf16 copies vs fp32 masters
        assert result.plan.b.path == (str(folder) if b == folder else str(ckpt / A.WEIGHTS_FILE))
        assert any("paired with peft's saved names" in x for x in result.plan.notes)
        assert any("B holds 16-bit copies" in x for x in result.plan.notes)
        assert any("A and B are the same checkpoint" in x for x in result.plan.notes) == (b != folder)
    ck = _copy(fx, tmp_path)
    save_file({}, ck / A.WEIGHTS_FILE)
    result = diff(ck, ck)
    assert [t.status for t in result.tensors] == ["only_in_a"] * n
    assert any("B is an empty adapter file" in x for x in result.plan.notes)
    (ck / A.WEIGHTS_FILE).unlink()  # no adapter file beside: the checkpoint with itself, as for any checkpoint
    assert all(t.status == "same" for t in diff(ck, ck).tensors)


# ------------------------------------------------------------------------------------------------ merge
def _peft_merged(fx, adapter_dir, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(fx["base_path"], dtype=dtype)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().state_dict()


def _tied(fx) -> dict:
    """``{alias: owner}`` of the base's tied weights (GPT-2: lm_head.weight is transformer.wte.weight)."""
    config = json.loads((fx["base_path"] / "config.json").read_text())
    return {"lm_head.weight": "transformer.wte.weight"} if config.get("tie_word_embeddings") else {}


def test_merge_equals_peft_merge_and_unload_bit_for_bit(peft_fixtures, tmp_path):
    """Acceptance (issue 31): every fixture, both --merge-on modes: the merged export holds, bit for bit, what peft's
    own merge_and_unload() gives on the same base (loaded in bf16 for base-dtype, fp32 for fp32) with the exported
    fp32 adapter; from_pretrained(OUT) loads it as it is, in that dtype, with every name; the note gives the gap
    between the modes."""
    pytest.importorskip("peft")
    import ckptlib
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ckptlib.export.merge import merge_adapter

    for fx in peft_fixtures.values():
        ckpt = fx["checkpoint_path"]
        adapter_dir = tmp_path / f"{fx['name']}-adapter"
        ckptlib.export(ckpt, adapter_dir)
        for mode, dtype in (("base-dtype", torch.bfloat16), ("fp32", torch.float32)):
            out = tmp_path / f"{fx['name']}-{mode}"
            result = merge_adapter(ckpt, out, fx["base_path"], merge_on=mode)
            assert ckptlib.verify(result.plan).ok, (fx["name"], mode)
            assert len(result.merged) == {"lora-qv": 4, "lora-all": 14, "dora": 8, "lora-emb": 3, "lora-bias": 8,
                                          "lora-bias-frozen": 6, "dora-bias-all": 8, "dora-emb": 3, "gpt2-lora": 6,
                                          "gpt2-dora": 6}[fx["method"]]
            assert len(result.biases) == {"lora-bias": 8, "lora-bias-frozen": 6, "dora-bias-all": 14}.get(fx["method"], 0)
            assert result.replaced == (["lm_head.weight"] if fx["method"] == "lora-all" else [])
            assert 1e-5 < result.mode_gap < 1e-2 and "apart here" in result.notes[1]
            theirs = _peft_merged(fx, adapter_dir, dtype)
            mine = load_file(out / "model.safetensors")
            tied = _tied(fx)  # GPT-2's lm_head: the base (save_pretrained) holds wte only, as the merge does
            assert set(mine) == set(theirs) - set(tied), fx["name"]
            assert all(torch.equal(theirs[alias], theirs[owner]) for alias, owner in tied.items())
            for k, v in mine.items():
                assert v.dtype == dtype and torch.equal(v, theirs[k].to(dtype)), (fx["name"], mode, k)
            model = AutoModelForCausalLM.from_pretrained(out)
            assert model.dtype == dtype
            loaded = model.state_dict()
            assert all(torch.equal(loaded[k], v) for k, v in mine.items())
            assert all(torch.equal(loaded[alias], mine[owner]) for alias, owner in tied.items())


def test_per_module_rank_and_alpha_are_peft_s(peft_fixtures, tmp_path):
    """rank_pattern / alpha_pattern (peft's get_pattern_key: the first key, in the saved config's order, matching the
    end of the module path): the r, alpha and scaling ckptlib gives every targeted module of the three pattern runs are
    those of the LoraLayers peft builds from the same adapter_config.json (layers.1's q_proj takes its own r=2 before
    "q_proj"'s 8; rsLoRA's alpha / sqrt(r)). A config whose patterns give another r than the trained factors have is
    refused before anything is written, and so is one that says use_dora where the checkpoint has no magnitude."""
    pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    from ckptlib.export.merge import merge_adapter

    for name in ("peft_lora_bias_z3", "peft_lora_bias_frozen_z2", "peft_dora_bias_all_z2"):
        fx = peft_fixtures[name]
        cfg = _config(fx)
        assert cfg.patterns and "per-module patterns" in cfg.describe()
        d, text = _inspect(fx["checkpoint_path"])
        assert d["adapter"]["rank_pattern"] == dict(cfg.rank_pattern) and d["adapter"]["bias"] == cfg.bias
        assert "            per module: rank_pattern " in text and "biases: " in text
        model, complaints = _load_peft(fx["base_path"], fx["checkpoint_path"])
        assert not complaints
        layers = {n: m for n, m in model.base_model.model.named_modules() if isinstance(m, LoraLayer)}
        assert len(layers) == {"lora-bias": 8, "lora-bias-frozen": 6, "dora-bias-all": 8}[fx["method"]]
        for n, m in layers.items():
            theirs = (m.r["default"], m.lora_alpha["default"], m.scaling["default"])
            assert cfg.module_scaling(n) == theirs, (name, n, theirs)
        assert len({cfg.module_scaling(n) for n in layers}) >= 3, name  # the patterns do change r or alpha
    fx = peft_fixtures["peft_lora_bias_z3"]
    cfg = _config(fx)
    assert [cfg.module_scaling(f"model.layers.{i}.self_attn.q_proj")[0] for i in (0, 1)] == [8, 2]
    raw = json.loads((fx["checkpoint_path"] / A.CONFIG_FILE).read_text())
    with pytest.raises(CkptError, match=r"q_proj.lora_A.default.weight has rank 2, but the adapter config gives "
                                        r"model.layers.1.self_attn.q_proj r=8"):
        merge_adapter(fx["checkpoint_path"], tmp_path / "x", fx["base_path"],
                      adapter_config=dict(raw, rank_pattern={"q_proj": 8}))
    emb = peft_fixtures["peft_lora_emb_z2"]
    raw = json.loads((emb["checkpoint_path"] / A.CONFIG_FILE).read_text())
    with pytest.raises(CkptError, match="config sets use_dora, but model.embed_tokens has no DoRA magnitude"):
        merge_adapter(emb["checkpoint_path"], tmp_path / "x", emb["base_path"], adapter_config=dict(raw, use_dora=True))
    dora = peft_fixtures["peft_dora_emb_z2"]
    raw = json.loads((dora["checkpoint_path"] / A.CONFIG_FILE).read_text())
    with pytest.raises(CkptError, match="does not set use_dora, but model.embed_tokens has a DoRA magnitude"):
        merge_adapter(dora["checkpoint_path"], tmp_path / "x", dora["base_path"],
                      adapter_config=dict(raw, use_dora=False))
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------ Conv1D, DoRA embedding
NEW_RUNS = ("peft_gpt2_lora_z2", "peft_gpt2_lora_z3", "peft_gpt2_dora_z2", "peft_dora_emb_z2", "peft_dora_emb_z3")


def test_gpt2_and_dora_embedding_runs_are_named_and_planned_as_peft_merges_them(peft_fixtures, tmp_path):
    """The runs of issue 40: GPT-2 (tied embeddings; its c_attn and c_proj are transformers' Conv1D, the weight stored
    [in, out]) with LoRA at ZeRO-2 and ZeRO-3 and DoRA at ZeRO-2, and DoRA on an embedding (with q_proj) at ZeRO-2 and
    ZeRO-3. peft set fan_in_fan_out in the saved config itself (train.py's LoraConfig leaves it unset); the Trainer's
    save leaves out the frozen wte and so its tied alias lm_head, which inspect says in a note, not as a problem;
    inspect names fan_in_fan_out and DoRA on the embedding; the merge plans each Conv1D weight (the square attention
    c_proj too) and the embedding as such."""
    import ckptlib
    from ckptlib.plan import MergedTensor
    from tests.fixtures.peft.train import METHODS

    hows = {"gpt2-lora": {"conv1d"}, "gpt2-dora": {"dora_conv1d"}, "dora-emb": {"dora_embedding", "dora"}}
    for name in NEW_RUNS:
        fx = peft_fixtures[name]
        gpt2 = fx["method"].startswith("gpt2")
        cfg = _config(fx)
        assert not METHODS[fx["method"]].get("fan_in_fan_out") and cfg.fan_in_fan_out == gpt2, name
        d, text = _inspect(fx["checkpoint_path"])
        a = d["adapter"]
        assert a["fan_in_fan_out"] == gpt2 and not d["problems"], (name, d["problems"])
        assert a["dora_embeddings"] == ([] if gpt2 else ["model.embed_tokens"])
        assert a["weights_file"]["status"] == "16-bit copy of the masters"
        if gpt2:
            assert "layers: fan_in_fan_out (peft's flag for Conv1D layers, whose weights are stored transposed" in text
            assert d["notes"] == ["tied parameter base_model.model.lm_head.weight shares base_model.model.transformer."
                                  "wte.weight, a frozen parameter the save left out (exclude_frozen_parameters): "
                                  "neither is in the checkpoint"]
        else:
            assert "layers: DoRA on the embedding model.embed_tokens (a magnitude per hidden feature" in text
        plan = ckptlib.plan_merge(fx["checkpoint_path"], tmp_path / name, fx["base_path"])
        merged = {t.name: t.how for t in plan.tensors if isinstance(t, MergedTensor)}
        assert set(merged.values()) == hows[fx["method"]], (name, merged)
        if gpt2:
            assert set(merged) == {f"transformer.h.{i}.{m}.weight" for i in (0, 1)
                                   for m in ("attn.c_attn", "attn.c_proj", "mlp.c_proj")}
        else:
            assert merged["model.embed_tokens.weight"] == "dora_embedding"
    full = ckptlib.open_checkpoint(peft_fixtures["peft_gpt2_lora_z3"]["full_save_path"])
    assert [p.tied_to for p in full.parameters if p.name == "base_model.model.lm_head.weight"] == \
        ["base_model.model.transformer.wte.weight"]  # saved with the frozen weights: the tie as DeepSpeed records it


def test_conv1d_layers_are_transformers_own():
    """ckptlib.kinds.adapters.CONV1D_LAYERS, the model types whose linear layers are Conv1D: every Conv1D module of a
    tiny model of each type (with cross-attention where it has one: q_attn) is named in the table, and no nn.Linear."""
    from transformers import AutoConfig, AutoModel
    from transformers.pytorch_utils import Conv1D

    for model_type, layers in A.CONV1D_LAYERS.items():
        kw = dict(n_layer=1, n_head=2, vocab_size=17, n_positions=8)
        if model_type == "decision_transformer":
            kw.update(hidden_size=8, state_dim=3, act_dim=2, max_ep_len=8)
        else:
            kw.update(n_embd=8)
        if model_type != "openai-gpt":
            kw["add_cross_attention"] = True
        model = AutoModel.from_config(AutoConfig.for_model(model_type, **kw))
        conv = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Conv1D)}
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert conv == set(layers) and not linear & conv, (model_type, conv, linear)


def test_which_layers_are_conv1d_or_a_refusal():
    """A model of the table is told by its layers' names (a shape that disagrees: another model); another by the
    shapes, a square layer taken for an nn.Linear only while nothing says the model has Conv1D layers."""
    gpt2 = {"h.0.attn.c_attn": ((64, 192), 64, 192), "h.0.attn.c_proj": ((64, 64), 64, 64), "lm_head": ((99, 64), 64, 99)}
    assert A.conv1d_modules(gpt2, "gpt2", True) == {"h.0.attn.c_attn", "h.0.attn.c_proj"}
    with pytest.raises(CkptError, match=r"h.0.attn.c_attn.weight is \[192, 64\], the adapter's is \[64, 192\] \(a gpt2 "
                                        r"c_attn is a Conv1D, stored \[in, out\]\): another model"):
        A.conv1d_modules(dict(gpt2, **{"h.0.attn.c_attn": ((192, 64), 64, 192)}), "gpt2", True)
    llama = {"q_proj": ((64, 64), 64, 64), "up_proj": ((172, 64), 64, 172)}
    assert A.conv1d_modules(llama, "llama", False) == set() and A.conv1d_modules(llama, None, False) == set()
    assert A.conv1d_modules({"c_fc": ((64, 256), 64, 256)}, "mystery", True) == {"c_fc"}  # the shape says it
    for layers, flag in ((llama, True), (dict(llama, c_fc=((64, 256), 64, 256)), False)):
        with pytest.raises(CkptError, match="q_proj.weight is square, in a model .model_type 'mystery'. whose Conv1D "
                                            "layers ckptlib does not know") as e:
            A.conv1d_modules(layers, "mystery", flag)
        assert "merge_and_unload()" in e.value.hint
    with pytest.raises(CkptError, match=r"up_proj.weight is \[3, 64\], the adapter's is \[172, 64\]: another model"):
        A.conv1d_modules({"up_proj": ((3, 64), 64, 172)}, "llama", False)


def test_gpt2_merge_refused_where_the_base_cannot_tell_its_conv1d_layers(peft_fixtures, tmp_path):
    """The GPT-2 run merged on its base whose config.json names another model type: the square attention c_proj
    (64 x 64) could be an nn.Linear or a Conv1D, and the merge is refused, naming it, before anything is written."""
    import shutil

    from ckptlib.export.merge import merge_adapter

    fx = peft_fixtures["peft_gpt2_lora_z2"]
    base = tmp_path / "base"
    shutil.copytree(fx["base_path"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(config, model_type="my-gpt")))
    with pytest.raises(CkptError, match=r"transformer.h.0.attn.c_proj.weight is square, in a model \(model_type "
                                        r"'my-gpt'\) whose Conv1D layers ckptlib does not know, and 4 of its targeted "
                                        r"layers are stored \[in, out\]"):
        merge_adapter(fx["checkpoint_path"], tmp_path / "x", base)
    assert not (tmp_path / "x").exists()


def test_module_rows_and_the_view_of_conv1d_and_dora_embedding_runs(peft_fixtures):
    """AdapterView's module table and movement figure on the GPT-2 runs (Conv1D weights [in, out]) and DoRA on the
    embedding: one row per targeted weight; ‖scaling · B·A‖_F and ‖W‖_F are torch's own, in float64, from the live
    engine's masters and the base's weights (a transposed layout changes neither); the picture's facts are the rows."""
    import math

    from safetensors.torch import load_file

    from ckptlib.ui import AdapterView
    from ckptlib.ui.pictures import facts_in_html

    for name in ("peft_gpt2_lora_z3", "peft_gpt2_dora_z2", "peft_dora_emb_z2"):
        fx = peft_fixtures[name]
        cfg = _config(fx)
        masters = _reference(fx)["fp32"]
        base = load_file(fx["base_path"] / "model.safetensors")
        want = {}
        for n, a in masters.items():
            for part_a, part_b in ((".lora_A.", ".lora_B."), (".lora_embedding_A.", ".lora_embedding_B.")):
                if part_a in n:
                    module = n[len(A.PREFIX):n.index(part_a)]
                    b = masters[n.replace(part_a, part_b)]
                    delta = cfg.scaling * (b.double() @ a.double())
                    want[module + ".weight"] = (torch.linalg.norm(delta).item(),
                                                torch.linalg.norm(base[module + ".weight"].double()).item())
        view = AdapterView(fx["checkpoint_path"], base=fx["base_path"])
        assert not view.errors.errors, view.errors.message.value
        rows = {r["tensor"]: r for r in view.rows}
        assert set(rows) == set(want) and len(rows) in (3, 6), name
        for tensor, (delta, norm) in want.items():
            r = rows[tensor]
            assert r["method"] == cfg.method and r["scaling"] == cfg.scaling, (name, r)
            assert math.isclose(r["delta_norm"], delta, rel_tol=1e-9) and math.isclose(r["base_norm"], norm, rel_tol=1e-9)
            assert f"<td>{tensor}</td>" in view.table.value
        (kind, facts), = facts_in_html(view.figure.value)
        assert kind == "adapter" and {f["tensor"]: f["delta_norm"] for f in facts} == \
            {t: r["delta_norm"] for t, r in rows.items()}
        if cfg.use_dora:
            assert "before the magnitude rescale" in view.figure.value


def test_merge_reads_a_sharded_base_and_refuses_with_reasons(peft_fixtures, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ckptlib.export.merge import merge_adapter

    fx = peft_fixtures["peft_lora_all_z2"]
    ckpt = fx["checkpoint_path"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(fx["base_path"]).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    merge_adapter(ckpt, tmp_path / "one", fx["base_path"])
    merge_adapter(ckpt, tmp_path / "many", sharded)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    many = {}
    for f in sorted(set(index["weight_map"].values())):
        many.update(load_file(tmp_path / "many" / f))
    one = load_file(tmp_path / "one" / "model.safetensors")
    assert set(one) == set(many) and all(torch.equal(one[k], many[k]) for k in one)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in one.values())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "many").dtype == torch.bfloat16

    with pytest.raises(CkptError, match="needs the base model") as e:
        merge_adapter(ckpt, tmp_path / "x", None)
    assert e.value.hint == f"ckpt export {ckpt} OUT --merge --base BASE_MODEL_FOLDER"
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    sd = load_file(fx["base_path"] / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(sd, wrong / "model.safetensors")
    with pytest.raises(CkptError, match=r"model.layers.1.mlp.up_proj.weight is \[3, 64\], the adapter's is \[172, 64\]"):
        merge_adapter(ckpt, tmp_path / "x", wrong)
    sd = load_file(fx["base_path"] / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, wrong / "model.safetensors")
    with pytest.raises(CkptError, match="holds no lm_head.weight"):
        merge_adapter(ckpt, tmp_path / "x", wrong)
    assert not (tmp_path / "x").exists()
    with pytest.raises(CkptError, match="would hold, or be inside, the base"):
        merge_adapter(ckpt, fx["base_path"], fx["base_path"], overwrite=True)
    with pytest.raises(CkptError, match="would hold, or be inside, the checkpoint"):
        merge_adapter(ckpt, ckpt / "merged", fx["base_path"])
    assert (fx["base_path"] / "model.safetensors").is_file()


def test_the_cli_merges(peft_fixtures, tmp_path):
    from tests.cli import assert_refused, run_cli

    fx = peft_fixtures["peft_dora_z3"]
    code, out, err = run_cli("export", fx["checkpoint_path"], tmp_path / "m", "--merge", "--base", fx["base_path"],
                             "--merge-on", "fp32")
    assert code == 0 and "merged 8 weights" in out and "merged on the fp32 base" in out, err
    assert_refused(*run_cli("export", fx["checkpoint_path"], tmp_path / "n", "--merge"),
                   ["--merge --base BASE_MODEL_FOLDER"], tmp_path / "n")
    assert_refused(*run_cli("export", fx["checkpoint_path"], tmp_path / "n", "--merge", "--base", fx["base_path"],
                            "--states", "all"), ["not with --states"], tmp_path / "n")


# ------------------------------------------------------------------------------------------------ transformers 4.x
@pytest.fixture(scope="module")
def peft_tf4_fixtures():
    from tests.fixtures.peft import factory

    root = factory.ensure_tf4_fixtures(verbose=False)
    if root is None:
        pytest.skip(f"{factory.TF4_ENV} names no python with transformers 4.x (tests/fixtures/peft/factory.py)")
    return {fx["name"]: fx for fx in factory.list_fixtures(root)}


def test_transformers_4_runs(peft_tf4_fixtures, tmp_path):
    """transformers 4.x runs (4.57.1 measured): at ZeRO-3 without the 16-bit gather the Trainer's adapter file is the
    40-byte empty one and inspect says so; the export loads in peft with no key warning, bit-equal to the live
    masters; the merge equals peft's merge_and_unload()."""
    pytest.importorskip("peft")
    import ckptlib
    from safetensors.torch import load_file

    from ckptlib.export.merge import merge_adapter

    assert len(peft_tf4_fixtures) == 4
    for fx in peft_tf4_fixtures.values():
        assert fx["versions"]["transformers"].startswith("4.")
        ckpt = fx["checkpoint_path"]
        status = _inspect(ckpt)[0]["adapter"]["weights_file"]["status"]
        if fx["gather16"] is False:
            assert status == "empty" and (ckpt / A.WEIGHTS_FILE).stat().st_size == 40, fx["name"]
        else:
            assert status == "16-bit copy of the masters", fx["name"]
        out = tmp_path / fx["name"]
        ckptlib.export(ckpt, out)
        ref = _reference(fx)
        model, complaints = _load_peft(fx["base_path"], out)
        assert not complaints
        params = dict(model.named_parameters())
        assert all(torch.equal(params[n].detach(), v) for n, v in ref["fp32"].items()), fx["name"]
        merge_adapter(ckpt, tmp_path / f"{fx['name']}-merged", fx["base_path"])
        theirs = _peft_merged(fx, out, torch.bfloat16)
        mine = load_file(tmp_path / f"{fx['name']}-merged" / "model.safetensors")
        assert all(torch.equal(v, theirs[k]) for k, v in mine.items()), fx["name"]


def test_a_save_with_the_base_weights(peft_fixtures, tmp_path):
    """engine.save_checkpoint without exclude_frozen_parameters: inspect says the base weights are in the checkpoint;
    the adapter export (config given: none is beside it) leaves them out, says so, and loads in peft bit-equal."""
    import ckptlib

    for name in ("peft_lora_all_z3", "peft_dora_z2"):
        fx = peft_fixtures[name]
        full = fx["full_save_path"]
        a = _inspect(full)[0]["adapter"]
        assert a["base_in_checkpoint"] and a["method"] is None and a["weights_file"] is None
        with pytest.raises(CkptError, match="no adapter_config.json is beside the tag"):
            ckptlib.plan_export(full, tmp_path / "x")
        plan = ckptlib.plan_export(full, tmp_path / name, adapter_config=fx["checkpoint_path"] / A.CONFIG_FILE)
        assert any("in the checkpoint too" in n for n in plan.notes)
        ckptlib.export(plan)
        model, complaints = _load_peft(fx["base_path"], tmp_path / name)
        assert not complaints
        params = dict(model.named_parameters())
        ref = _reference(fx)
        assert all(torch.equal(params[n].detach(), v) for n, v in ref["fp32"].items()), name


# ------------------------------------------------------------------------------------------------ the merge as a plan
def _merged_names(plan) -> list:
    from ckptlib.plan import MergedTensor

    return [t for t in plan.tensors if isinstance(t, MergedTensor)]


def test_the_merge_plan_is_plain_data_and_run_by_the_one_runner(peft_fixtures, tmp_path):
    """plan_merge reads metadata only: a plan of MergedTensors (the base tensor's range, the factors' ranges, the
    scaling, the merge dtype) that pickles and runs in another process to the same bytes as here; ckptlib.run carries
    it out (atomic, memory measured, within the predicted peak) and ckptlib.verify re-reads every tensor."""
    import pickle
    import subprocess
    import sys

    import ckptlib
    from ckptlib.plan import Factor, MergedTensor

    fx = peft_fixtures["peft_dora_bias_all_z2"]
    plan = ckptlib.plan_merge(fx["checkpoint_path"], tmp_path / "here", fx["base_path"])
    other = ckptlib.plan_merge(fx["checkpoint_path"], tmp_path / "there", fx["base_path"])
    assert isinstance(plan, ckptlib.MergePlan) and plan.action == "merge"
    merged = _merged_names(plan)
    assert {t.how for t in merged} == {"dora", "bias"} and len(plan.merged) == 8 and len(plan.biases) == 14
    assert all(isinstance(f, Factor) and f.ranges for t in merged for f in t.factors)
    assert {t.merge_dtype for t in merged} == {"bfloat16"} and all(t.ranges[0].dtype == "float32" for t in merged)
    kept = [t for t in plan.tensors if not isinstance(t, MergedTensor)]
    assert kept and {t.kind for t in kept} == {"base"} and {t.dtype for t in kept} == {"bfloat16"}
    d = plan.to_dict()
    assert d["merged"] == plan.merged and d["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert "merge" in plan.describe() and "predicted peak memory" in plan.describe()
    assert ckptlib.preflight(plan).ok
    result = ckptlib.run(plan)
    assert type(result) is ckptlib.RunResult and result.memory.peak_added <= plan.predicted_peak_bytes
    blob = tmp_path / "plan.pkl"
    blob.write_bytes(pickle.dumps(other))
    code = "import pickle, sys, ckptlib; print(ckptlib.run(pickle.load(open(sys.argv[1], 'rb'))).action)"
    r = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "merge", r.stderr[-2000:]
    for f in (tmp_path / "here").iterdir():
        assert f.read_bytes() == (tmp_path / "there" / f.name).read_bytes(), f.name
    check = ckptlib.verify(other)
    assert check.ok, check.describe()
    assert any("every merged weight and bias equals its recomputation" in c.what and c.detail == "22 of 22"
               for c in check.checks)


def test_merge_verify_finds_a_damaged_output(peft_fixtures, tmp_path):
    """--verify: the merged weights recomputed, the untouched ones compared with the base, bit for bit; a flipped bit
    in either (or an edited config) fails verification, naming the tensor."""
    import ckptlib
    from ckptlib.io.stformat import read_header

    fx = peft_fixtures["peft_lora_all_z3"]
    plan = ckptlib.plan_merge(fx["checkpoint_path"], tmp_path / "m", fx["base_path"], merge_on="fp32")
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    weights = tmp_path / "m" / "model.safetensors"
    where = {t.name: t for t in read_header(weights)[1]}
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.norm.weight", "lm_head.weight"):
        original = weights.read_bytes()
        with open(weights, "r+b") as f:
            f.seek(where[name].offset + where[name].nbytes // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x04]))
        check = ckptlib.verify(plan)
        assert not check.ok and name in check.describe(), (name, check.describe())
        weights.write_bytes(original)
    assert ckptlib.verify(plan).ok
    config = tmp_path / "m" / "config.json"
    config.write_text(config.read_text().replace("float32", "bfloat16"))
    assert not ckptlib.verify(plan).ok


def test_merge_cancel_leaves_nothing(peft_fixtures, tmp_path):
    import threading

    import ckptlib

    fx = peft_fixtures["peft_lora_qv_z2"]
    plan = ckptlib.plan_merge(fx["checkpoint_path"], tmp_path / "out" / "m", fx["base_path"])
    stop = threading.Event()
    merged = set(plan.merged)

    class StopAtTheSecondMerge(ckptlib.Observer):
        seen = 0

        def on_tensor(self, name):
            self.seen += name in merged
            if self.seen == 2:
                stop.set()

    with pytest.raises(ckptlib.Cancelled):
        ckptlib.merge_adapter(plan, observer=StopAtTheSecondMerge(), cancel=stop)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_the_cli_plans_merges_and_verifies(peft_fixtures, tmp_path, monkeypatch, capsys):
    """``--merge --plan`` prints the plan (text and JSON) and reads no tensor byte (every reader of tensor data
    made to fail); ``--merge --verify`` writes, verifies and says how far the two modes lie apart."""
    from ckptlib.cli.main import main
    from ckptlib.io import sources, streaming

    fx = peft_fixtures["peft_lora_emb_z2"]
    out = tmp_path / "m"

    def refuse(*a, **k):
        raise AssertionError("tensor bytes read")

    with monkeypatch.context() as m:
        for name in ("read_into", "read_gather", "read_scattered"):
            m.setattr(sources.SourceFiles, name, refuse)
        m.setattr(streaming, "read_ranges", refuse)
        assert main(["export", str(fx["checkpoint_path"]), str(out), "--merge", "--base", str(fx["base_path"]),
                     "--plan"]) == 0
        text = capsys.readouterr().out
        assert "3 weights merged" in text and "predicted peak memory" in text and "model.embed_tokens.weight" in text
        assert main(["export", str(fx["checkpoint_path"]), str(out), "--merge", "--base", str(fx["base_path"]),
                     "--plan", "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["merged"] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                               "model.layers.1.self_attn.q_proj.weight"] and d["dtype"] == "bfloat16"
    assert not out.exists()
    assert main(["export", str(fx["checkpoint_path"]), str(out), "--merge", "--base", str(fx["base_path"]),
                 "--verify"]) == 0
    text = capsys.readouterr().out
    assert "merged 3 weights" in text and "apart here" in text and "verified: " in text
    assert "every merged weight and bias equals its recomputation" in text


MEASURE = """
import json, re, sys
import torch
from ckptlib.io.lora_merge import arithmetic_bytes, merged_value
from ckptlib.io.sources import SourceFiles
import pickle

def rss(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

tensors = pickle.load(open(sys.argv[1], "rb"))
files = SourceFiles()
out = []
for t in tensors:
    before = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    value = merged_value(t, files)
    out.append((t.how, t.merge_dtype, rss("VmHWM") - before, arithmetic_bytes(t)))
    del value
print(json.dumps(out))
"""


def test_merging_a_tensor_holds_no_more_than_the_plan_says(tmp_path):
    """What merging one tensor holds (measured: the kernel's peak resident set, reset before each, with every large
    allocation returned to the kernel when freed) stays within arithmetic_bytes, which the plan's predicted peak
    adds to its streaming buffers: a linear, Conv1D, embedding weight of 2048 x 2048 (plain and DoRA) and a bias,
    merged on bf16 and on fp32."""
    import os
    import pickle
    import subprocess
    import sys

    from safetensors.torch import save_file

    from ckptlib.io.lora_merge import base_headers, stored_ranges
    from ckptlib.plan import Factor, MergedTensor

    n, r = 2048, 8
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(n, n, generator=g), "b": torch.randn(n, generator=g)}, tmp_path / "base.safetensors")
    save_file({"A": torch.randn(r, n, generator=g), "B": torch.randn(n, r, generator=g),
               "m": torch.rand(n, generator=g) + 0.5, "lb": torch.randn(n, generator=g),
               "tb": torch.randn(n, generator=g)}, tmp_path / "adapter.safetensors")
    held = {t.name: (stored_ranges(f, t), tuple(t.shape)) for f, ts in
            base_headers([tmp_path / "base.safetensors", tmp_path / "adapter.safetensors"]).items() for t in ts}

    def factor(role, name):
        return Factor(role, name, held[name][1], held[name][0])

    parts = {"linear": ("w", ("A", "B")), "dora": ("w", ("A", "B", "m")), "embedding": ("w", ("A", "B")),
             "conv1d": ("w", ("A", "B")), "dora_conv1d": ("w", ("A", "B", "m")), "dora_embedding": ("w", ("A", "B", "m")),
             "bias": ("b", ("tb", "lb"))}
    roles = {"A": "A", "B": "B", "m": "magnitude", "tb": "bias", "lb": "lora_bias"}
    tensors = [MergedTensor(base, held[base][1], md, how, md, 2.0, tuple(factor(roles[x], x) for x in names),
                            held[base][0]) for md in ("bfloat16", "float32") for how, (base, names) in parts.items()]
    (tmp_path / "t.pkl").write_bytes(pickle.dumps(tensors))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "t.pkl")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for how, md, peak, bound in json.loads(proc.stdout):
        assert peak <= bound, (how, md, peak, bound)
        if how != "bias":
            assert peak >= 2 * n * n * 4, (how, md, peak)  # measured, not nothing: at least two fp32 copies
