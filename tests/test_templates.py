"""Templates: StrictUndefined errors name the variable; the Dockerfile renders exactly (golden)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_ops.core import rendering
from remote_ops.core.inventory import parse_inventory_data
from remote_ops.engine import labels as labels_
from remote_ops.errors import ConfigError
from remote_ops.workflows import deploy

GOLDEN = Path(__file__).parent / "data" / "Dockerfile.golden"
SHA_BEFORE = "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35"
SHA_AFTER = "a" * 64


def gpu_node():
    entry = {"address": "10.1.230.174", "sglang": {"patch": "deepseek-v2"}}
    return parse_inventory_data({"hosts": {"gpu-node": entry}}, "test.yaml")[0]


def golden_variables():
    """Fixed inputs (no file hashes) so the golden file changes only when the template does."""
    patch = deploy.load_patch(gpu_node())
    variables = deploy.dockerfile_variables(gpu_node(), patch, SHA_BEFORE, SHA_AFTER, "c0ffee")
    variables["labels"][labels_.PATCH_HASH] = "0123456789abcdef"
    variables["remote_ops_version"] = "0.0.0-test"
    variables["labels"][labels_.TOOL_VERSION] = "0.0.0-test"
    return variables


def test_undefined_variable_is_a_config_error_naming_it():
    variables = golden_variables()
    del variables["base_image"]
    with pytest.raises(ConfigError) as info:
        rendering.render(rendering.DOCKERFILE, variables)
    assert "base_image" in info.value.message and info.value.exit_code == 3


def test_missing_nested_attribute_is_named():
    variables = golden_variables()
    del variables["healthcheck"]["start_period_s"]
    with pytest.raises(ConfigError) as info:
        rendering.render(rendering.DOCKERFILE, variables)
    assert "start_period_s" in info.value.message


def test_render_string_is_strict_too():
    with pytest.raises(ConfigError, match="nope"):
        rendering.render_string("{{ nope }}", {})


def test_golden_dockerfile():
    text = rendering.render(rendering.DOCKERFILE, golden_variables())
    assert text == GOLDEN.read_text(), "template changed: review, then regenerate tests/data/Dockerfile.golden"


def test_dockerfile_essentials():
    text = rendering.render(rendering.DOCKERFILE, golden_variables())
    assert text.splitlines()[2] == "FROM lmsysorg/sglang:v0.5.9-cu129"
    assert "/get_model_info" in text and "/health'" not in text, "HEALTHCHECK must use a cheap endpoint"
    assert "--start-period=1800s" in text
    assert f'org.remote-ops.source.sha256.after="{SHA_AFTER}"' in text
    assert f"verify_patch.py --expect-sha256 {SHA_AFTER}" in text


def test_context_hash_changes_with_the_patched_file():
    host = gpu_node()
    patch = deploy.load_patch(host)
    assert deploy.context_hash(host, patch, SHA_BEFORE, SHA_AFTER) != deploy.context_hash(
        host, patch, SHA_BEFORE, "b" * 64
    )
    assert deploy.context_hash(host, patch, SHA_BEFORE, SHA_AFTER) == deploy.context_hash(
        host, patch, SHA_BEFORE, SHA_AFTER
    )


def test_standin_base_template_renders():
    text = rendering.render(
        "standin-base.Dockerfile.j2",
        {"base_image": "b", "sglang_version": "0.5.9", "standin_dir": "/opt/s", "stands_in_for": "x"},
    )
    assert "STAND-IN" in text and "FROM b" in text
