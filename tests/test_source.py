"""inspect-source: numbered, scope-annotated listings of the real 0.5.9 file (pure + CLI on a local file)."""

from __future__ import annotations

import json
import shutil

import pytest

from remote_ops import wheels
from remote_ops.cli.main import main
from remote_ops.core import source as S
from remote_ops.errors import NotFound, UsageError

DSV2 = "python/sglang/srt/models/deepseek_v2.py"

SHA_059 = "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35"


@pytest.fixture(scope="module")
def data() -> bytes:
    return wheels.sglang_source("0.5.9", DSV2)


@pytest.fixture(scope="module")
def text(data) -> S.Text:
    return S.Text.of(data)


@pytest.fixture
def local_file(tmp_path, data):
    path = tmp_path / "deepseek_v2.py"
    path.write_bytes(data)
    return path


def test_lines_2830_2845_are_the_users_lines(text, data):
    listing = S.lines_view(text, "2830:2845")
    expected = data.decode().split("\n")[2829:2845]
    assert [r.n for r in listing.rows] == list(range(2830, 2846))
    assert [r.text for r in listing.rows] == expected
    flag = listing.rows[2837 - 2830]
    assert flag.text == "        self.capture_aux_hidden_states = False"
    assert flag.scope == "DeepseekV2ForCausalLM.__init__"
    assert listing.rows[0].text.strip().startswith("self._routed_experts_weights_of_layer = LazyValue(")
    assert listing.command.startswith("sed -n '2830,2845p'")


def test_grep_like_grep_n(text):
    rows = S.grep_view(text, "capture_aux_hidden_states").rows
    assert [r.n for r in rows] == [2837, 2923, 2968, 2972]
    assert [r.scope for r in rows] == [
        "DeepseekV2ForCausalLM.__init__",
        "DeepseekV2ForCausalLM.forward",
        "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
        "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
    ]


def test_symbol(text):
    (listing,) = S.symbol_view(text, "DeepseekV2ForCausalLM.forward")
    assert listing.rows[0].n == 2900 and listing.rows[0].text.strip() == "@torch.no_grad()"
    assert any(r.n == 2923 for r in listing.rows)
    with pytest.raises(NotFound):
        S.symbol_view(text, "NoSuchClass.method")


@pytest.mark.parametrize("bad", ["2845:2830", "abc", "2980:2990", "0:3", "", "1:2:3", "-5:3"])
def test_bad_ranges(text, bad):
    with pytest.raises(UsageError):
        S.parse_range(bad, text.count)


def test_single_line_and_comma(text):
    assert S.parse_range("2837", text.count) == (2837, 2837)
    assert S.parse_range("2830,2845", text.count) == (2830, 2845)
    assert S.parse_range("2986:2986", text.count) == (2986, 2986)


def test_binary_and_bad_pattern(text):
    with pytest.raises(UsageError):
        S.Text.of(b"\x7fELF\x02\x01\x00\x00")
    with pytest.raises(UsageError):
        S.grep_view(text, "(unclosed")


def test_syntax_error_still_lists(data):
    broken = data.replace(b"LogitsProcessor(config)\n", b"LogitsProcessor(config\n", 1)
    t = S.Text.of(broken)
    assert t.parse_error and t.rows(2837, 2837)[0].scope == "?"


def test_render_has_numbers_and_scope(text):
    out = S.lines_view(text, "2837:2837").render()
    assert " 2837  DeepseekV2ForCausalLM.__init__ |         self.capture_aux_hidden_states = False" in out


# ------------------------------------------------------------------ CLI, local
def test_cli_lines_json(local_file, capsys):
    rc = main(["inspect-source", "--local-file", str(local_file), "--lines", "2830:2845", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sha256"] == SHA_059 and doc["lines"] == 2986 and doc["sglang_version"] == "0.5.9"
    rows = doc["listings"][0]["rows"]
    assert rows[7] == {
        "n": 2837,
        "text": "        self.capture_aux_hidden_states = False",
        "scope": "DeepseekV2ForCausalLM.__init__",
        "mark": "",
    }


@pytest.mark.parametrize(
    "args,code",
    [
        (["--lines", "2845:2830"], 2),
        (["--lines", "abc"], 2),
        (["--lines", "2980:3000"], 2),
        (["--grep", "("], 2),
        (["--lines", "1:2", "--grep", "x"], 2),
        ([], 2),
        (["--symbol", "Nope.nope"], 13),
    ],
)
def test_cli_bad_input_exit_codes(local_file, args, code):
    before = local_file.read_bytes()
    assert main(["inspect-source", "--local-file", str(local_file), *args]) == code
    assert local_file.read_bytes() == before


def test_cli_missing_and_binary_file(tmp_path):
    # a missing local file is a usage error, found while parsing (core.pathref)
    assert main(["inspect-source", "--local-file", str(tmp_path / "missing.py"), "--lines", "1:2"]) == 2
    binary = tmp_path / "blob.py"
    shutil.copy("/bin/true", binary)
    assert main(["inspect-source", "--local-file", str(binary), "--lines", "1:2"]) == 2


def test_cli_needs_host_or_local_file():
    assert main(["inspect-source", "--lines", "1:2"]) == 2
