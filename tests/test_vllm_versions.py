"""The supported vLLM versions are stated once (engine_adapters/vllm/versions.py): the deploy files pin the
image of the release the real-vLLM suite runs, the scripts that build that suite's vLLM install the same release,
and the adapter's version-dependent formats belong to supported series."""

from __future__ import annotations

import re
import typing

import yaml

from engine_adapters.vllm.kv_events import WIRE_FORMATS
from engine_adapters.vllm.versions import CHECKED_VLLM, SUPPORTED_VLLM, VLLM_IMAGE, supported
from gateway.config import KvEventsConfig
from tests.helpers import ROOT

DEPLOY_FILES = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").rglob("*.yaml"))]


def test_every_vllm_image_in_the_deploy_files_is_the_checked_release() -> None:
    pins = [(p.relative_to(ROOT).as_posix(), m) for p in DEPLOY_FILES
            for m in re.findall(r"vllm/vllm-openai:(\S+)", p.read_text(encoding="utf-8"))]
    assert len(pins) >= 5, pins  # docker-compose's two GPU workers and the three Kubernetes pools
    assert {tag for _, tag in pins} == {VLLM_IMAGE.split(":", 1)[1]}, pins


def test_kustomize_image_overrides_keep_the_checked_tag() -> None:
    tags = []
    for p in DEPLOY_FILES:
        for doc in yaml.safe_load_all(p.read_text(encoding="utf-8")):
            for image in (doc or {}).get("images", []) if isinstance(doc, dict) else []:
                if image.get("name") == "vllm/vllm-openai":
                    tags.append((p.relative_to(ROOT).as_posix(), image.get("newTag")))
    assert len(tags) >= 2, tags  # the images component and the CPU overlay
    assert {t for _, t in tags} == {f"v{CHECKED_VLLM}"}, tags


def test_the_real_vllm_suite_builds_the_checked_release() -> None:
    env_sh = (ROOT / "scripts" / "vllm_env.sh").read_text(encoding="utf-8")
    servers = (ROOT / "scripts" / "vllm_servers.py").read_text(encoding="utf-8")
    assert re.search(r'^VLLM_VERSION="([^"]+)"', env_sh, re.M).group(1) == CHECKED_VLLM
    assert re.search(r'^VLLM_VERSION = "([^"]+)"', servers, re.M).group(1) == CHECKED_VLLM


def test_version_dependent_formats_are_of_supported_series() -> None:
    assert supported(CHECKED_VLLM)
    hash_styles = typing.get_args(KvEventsConfig.model_fields["hash_style"].annotation)
    for v in (*WIRE_FORMATS, *hash_styles):
        assert v in SUPPORTED_VLLM, v
    assert supported("v0.11.1") and supported("0.33.0rc1")
    assert not supported("0.10.2") and not supported("1") and not supported("")
