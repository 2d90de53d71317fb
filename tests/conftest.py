"""Session fixtures: real DeepSpeed checkpoints, made once and cached (see tests/fixtures/factory.py).

Tests that take ``ds_fixture`` run once per fixture configuration; the names are known at collection
time from the generator's own list, the checkpoints are made (or found in the cache) on first use.
``CKPTLIB_FIXTURE_WORLDS`` (default ``1,2,3,4``) limits the world sizes.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

WORLDS = tuple(int(w) for w in os.environ.get("CKPTLIB_FIXTURE_WORLDS", "1,2,3,4").split(","))


def fixture_names() -> list[str]:
    from tests.fixtures.generate import all_specs

    return [s.name for w in WORLDS for s in all_specs(w)]


@pytest.fixture(scope="session")
def ds_fixtures() -> dict:
    from tests.fixtures.factory import ensure_fixtures, list_fixtures

    root = ensure_fixtures(worlds=WORLDS)
    out = {}
    for fx in list_fixtures(root):
        fx["path"] = Path(fx["path"])
        fx["checkpoint_path"] = Path(fx["checkpoint_path"])
        out[fx["name"]] = fx
    return out


@pytest.fixture(scope="session")
def fixture_by_name(ds_fixtures):
    def get(name: str) -> dict:
        if name not in ds_fixtures:
            pytest.skip(f"fixture {name} not generated (CKPTLIB_FIXTURE_WORLDS={','.join(map(str, WORLDS))})")
        return ds_fixtures[name]

    return get


@pytest.fixture
def ds_fixture(request, fixture_by_name):
    return fixture_by_name(request.param)


@pytest.fixture(scope="session")
def parallel_fixtures() -> dict:
    """Pipeline, tensor-parallel, MoE, AutoTP, Ulysses and pipeline x tensor x data (3D) checkpoints made by
    DeepSpeed (cached; see tests/fixtures/parallel, tests/fixtures/hf_parallel and tests/fixtures/mesh), by name."""
    from tests.fixtures.hf_parallel import factory as hf_factory
    from tests.fixtures.mesh import factory as mesh_factory
    from tests.fixtures.parallel import factory as par_factory

    out = {}
    for factory in (par_factory, hf_factory, mesh_factory):
        for fx in factory.list_fixtures(factory.ensure_fixtures(verbose=False)):
            out[fx["name"]] = fx
    return out


def pytest_generate_tests(metafunc):
    if "ds_fixture" in metafunc.fixturenames:
        names = fixture_names()
        only = getattr(metafunc.function, "fixture_filter", None)
        if only is not None:
            names = [n for n in names if only(n)]
        metafunc.parametrize("ds_fixture", names, indirect=True)


def _family(factory: str) -> dict:
    """``{name: fixture.json with absolute path and checkpoint_path}`` of a fixture family, built once."""
    import importlib

    mod = importlib.import_module(factory)
    return {fx["name"]: fx for fx in mod.list_fixtures(mod.ensure_fixtures(verbose=False))}


@pytest.fixture(scope="session")
def optim_fixtures() -> dict:
    """Checkpoints made with every optimizer (tests/fixtures/optim)."""
    return _family("tests.fixtures.optim.factory")


@pytest.fixture(scope="session")
def bf16_master_fixtures() -> dict:
    """AdamW at ZeRO-1/2/3 with bf16 masters and moments (bf16_master_weights_and_grads; tests/fixtures/bf16_masters)."""
    return _family("tests.fixtures.bf16_masters.factory")


@pytest.fixture(scope="session")
def peft_fixtures() -> dict:
    """LoRA / DoRA adapters trained through the HF Trainer + DeepSpeed (tests/fixtures/peft); skipped without peft."""
    pytest.importorskip("peft", reason="the peft fixtures train with peft (pip install peft==0.21.2)")
    return _family("tests.fixtures.peft.factory")


@pytest.fixture(scope="session")
def legacy_fixtures() -> dict:
    """ZeRO-1/2/3, pipeline and MoE checkpoints saved in torch's legacy serialization (tests/fixtures/legacy)."""
    return _family("tests.fixtures.legacy.factory")


@pytest.fixture(scope="session")
def autoep_fixtures() -> dict:
    """AutoEP checkpoints (tests/fixtures/autoep)."""
    return _family("tests.fixtures.autoep.factory")


def only_fixtures(predicate):
    """Decorator: run a ``ds_fixture`` test only on fixtures whose name satisfies ``predicate``."""
    def deco(fn):
        fn.fixture_filter = predicate
        return fn
    return deco


# ----------------------------------------------------------------------------------------------- order
# The NVMe tests need DeepSpeed's async_io op, which scripts/test.sh builds in the background (about 20
# CPU-minutes, once) while the other tests run: they go last, so the build overlaps the rest of the suite.
LAST = ("tests/test_nvme.py",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] in LAST)  # stable: the order within each part stays


# ----------------------------------------------------------------------------------------------- exit
# Native threads that torch, gloo and the browser/Jupyter stack leave behind can make the interpreter abort
# while it tears down ("terminate called without an active exception", exit 134) after every test passed and
# pytest printed its summary; seen once in a full CI-clone run. The suite's verdict is pytest's exit status, so
# once pytest is completely done we leave without the interpreter teardown. CKPTLIB_HARD_EXIT=0 turns it off.
_EXIT_STATUS = None


def pytest_sessionfinish(session, exitstatus):
    global _EXIT_STATUS
    _EXIT_STATUS = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: it still has to report to the controller
        return
    if _EXIT_STATUS is not None and os.environ.get("CKPTLIB_HARD_EXIT", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS)
