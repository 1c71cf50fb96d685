"""Groups as Ansible has them (issue 29, item 4): a `groups:` section with `hosts:` and `children:`,
a host in several groups, file stems still groups; patterns with `,` `:` `&` `!` evaluated in
Ansible's order.  Pure (loader and selection) plus one CLI run of `hosts --host PATTERN` on a
temporary inventory (nothing connects)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli

from remote_ops.core import targets
from remote_ops.core.inventory import load_inventory
from remote_ops.core.rawinv import raw_hosts
from remote_ops.errors import ConfigError, UsageError

#: Ansible's documented examples (docs.ansible.com, "Patterns: targeting hosts and groups") need
#: groups named webservers, dbservers, staging, atlanta, phoenix; hosts are in several of them.
HOSTS = """\
hosts:
  web1: {address: 127.0.10.1}
  web2: {address: 127.0.10.2}
  web3: {address: 127.0.10.3}
  db1: {address: 127.0.10.4}
  db2: {address: 127.0.10.5}
  one.example.com: {address: 127.0.10.6}
"""
GROUPS = """\
groups:
  webservers:
    hosts: [web1, web2, web3]
  dbservers:
    hosts:            # Ansible's YAML form: a mapping of names to nothing
      db1:
      db2:
  atlanta:
    hosts: [web1, db1]
  phoenix:
    hosts: [web2, db2]
  staging:
    hosts: [web2, web3, db2]
  prod:
    children: [atlanta]
    hosts: [one.example.com]
"""


@pytest.fixture
def inventory(tmp_path: Path):
    (tmp_path / "site.yaml").write_text(HOSTS)
    (tmp_path / "groups.yaml").write_text(GROUPS)
    return load_inventory([tmp_path])


def names(hosts) -> list[str]:
    return [h.name for h in hosts]


# -- pattern semantics: Ansible's documented examples ------------------------------------------


@pytest.mark.parametrize(
    "pattern,want",
    [
        # "All hosts: all (or *)"
        ("all", ["web1", "web2", "web3", "db1", "db2", "one.example.com"]),
        ("*", ["web1", "web2", "web3", "db1", "db2", "one.example.com"]),
        # "One host", "Multiple hosts: host1:host2 (or host1,host2)"
        ("web1", ["web1"]),
        ("web1:db2", ["web1", "db2"]),
        ("web1,db2", ["web1", "db2"]),
        # "One group", "Multiple groups: all hosts in webservers plus all hosts in dbservers"
        ("webservers", ["web1", "web2", "web3"]),
        ("webservers:dbservers", ["web1", "web2", "web3", "db1", "db2"]),
        # "Excluding groups: all hosts in webservers except those in atlanta"
        ("webservers:!atlanta", ["web2", "web3"]),
        # "Intersection of groups: any hosts in webservers that are also in staging"
        ("webservers:&staging", ["web2", "web3"]),
        # "all machines in the groups webservers and dbservers that are also in staging, except phoenix"
        ("webservers:dbservers:&staging:!phoenix", ["web3"]),
        # wildcards, and wildcards mixed with groups ("one*.com:dbservers")
        ("*.example.com", ["one.example.com"]),
        ("one*.com:dbservers", ["one.example.com", "db1", "db2"]),
        # --limit 'all:!host1'
        ("all:!web1", ["web2", "web3", "db1", "db2", "one.example.com"]),
        # a group's children are in it
        ("prod", ["web1", "db1", "one.example.com"]),
        ("prod:&webservers", ["web1"]),
    ],
)
def test_ansible_documented_patterns(inventory, pattern, want):
    assert names(targets.select(inventory, pattern)) == want


def test_processing_order_is_unions_then_intersections_then_exclusions(inventory):
    """Ansible: `a:b:&c:!d:!e == &c:a:!d:b:!e == !d:a:!e:&c:b`: host in (a or b) and in c and not in d, e."""
    a_b_c_d_e = ["webservers:dbservers:&staging:!phoenix:!atlanta", "&staging:webservers:!phoenix:dbservers:!atlanta"]
    a_b_c_d_e.append("!phoenix:webservers:!atlanta:&staging:dbservers")
    assert {tuple(names(targets.select(inventory, p))) for p in a_b_c_d_e} == {("web3",)}
    # an exclusion written first still applies after the union: not "all minus phoenix, then add webservers"
    assert names(targets.select(inventory, "!phoenix,webservers")) == ["web1", "web3"]
    # every & term must hold (all(c)), not any of them
    assert names(targets.select(inventory, "all:&webservers:&staging:&phoenix")) == ["web2"]


def test_only_exclusions_or_intersections_start_from_all(inventory):
    assert names(targets.select(inventory, "!webservers")) == ["db1", "db2", "one.example.com"]
    assert names(targets.select(inventory, "&staging")) == ["web2", "web3", "db2"]


def test_limit_narrows_with_a_second_pattern(inventory):
    assert names(targets.select(inventory, "webservers", limit="staging:!phoenix")) == ["web3"]
    assert names(targets.select(inventory, None, all_hosts=True, limit="atlanta")) == ["web1", "db1"]


@pytest.mark.parametrize(
    "pattern,want",
    [
        ("a:b,c", ["a", "b", "c"]),
        ("fleet:&rack-2:!gpu-03", ["fleet", "&rack-2", "!gpu-03"]),
        ("ops@10.9.8.7:2200", ["ops@10.9.8.7:2200"]),
        ("gpu-01:2222,fleet", ["gpu-01:2222", "fleet"]),
        ("::1", ["::1"]),
        ("fe80::1,fleet", ["fe80::1", "fleet"]),
        ("[::1]:2222,fleet", ["[::1]:2222", "fleet"]),
        ("!fleet:gpu", ["!fleet", "gpu"]),
    ],
)
def test_split_pattern_keeps_addresses_whole(pattern, want):
    assert targets.split_pattern(pattern) == want


@pytest.mark.parametrize("pattern", ["fleet:!", "&,fleet"])
def test_a_bare_operator_is_a_usage_error(inventory, pattern):
    with pytest.raises(UsageError, match="needs a host, group or glob"):
        targets.select(inventory, pattern)


def test_an_unknown_group_in_an_exclusion_is_an_error_with_close_matches(inventory):
    with pytest.raises(ConfigError) as err:
        targets.select(inventory, "webservers:!stagin")
    assert "staging" in (err.value.hint or "")


# -- the loader ---------------------------------------------------------------------------------


def test_a_host_is_in_several_groups_and_lists_them(inventory):
    assert inventory.hosts["web2"].groups == ("phoenix", "site", "staging", "webservers")  # site: its file
    assert inventory.hosts["web1"].groups == ("atlanta", "prod", "site", "webservers")  # prod through its child
    assert inventory.groups["prod"] == ("web1", "db1", "one.example.com")  # inventory order
    assert inventory.children["prod"] == ("atlanta",)
    assert inventory.group_sources["webservers"] == (str(inventory.sources[0]),)  # groups.yaml sorts first


def test_file_stems_stay_groups_and_merge_with_a_groups_entry(tmp_path):
    (tmp_path / "fleet.yaml").write_text("hosts:\n  gpu-01: {}\n  gpu-02: {}\n  gpu-03: {}\n")
    (tmp_path / "trainer.yaml").write_text(
        "hosts:\n  trainer: {}\ngroups:\n  fleet:\n    hosts: [trainer]\n  rack-2:\n    hosts: [gpu-02, gpu-03]\n"
    )
    inv = load_inventory([tmp_path])
    assert inv.groups["fleet"] == ("gpu-01", "gpu-02", "gpu-03", "trainer")
    assert inv.group_sources["fleet"] == (str(tmp_path / "fleet.yaml"), str(tmp_path / "trainer.yaml"))
    assert names(targets.select(inv, "fleet,&rack-2")) == ["gpu-02", "gpu-03"]  # the README's own example
    assert inv.hosts["gpu-02"].groups == ("fleet", "rack-2")


def test_children_nest_several_levels(tmp_path):
    (tmp_path / "a.yaml").write_text(
        "hosts:\n  h1: {}\n  h2: {}\n  h3: {}\n"
        "groups:\n  top:\n    children: [mid]\n  mid:\n    children: [low]\n    hosts: [h1]\n  low:\n    hosts: [h3]\n"
    )
    inv = load_inventory([tmp_path / "a.yaml"])
    assert inv.groups["top"] == ("h1", "h3") and inv.groups["low"] == ("h3",)
    assert inv.hosts["h3"].groups == ("a", "low", "mid", "top")


def _refused(tmp_path: Path, groups: str, hosts: str = "hosts:\n  h1: {}\n  h2: {}\n") -> ConfigError:
    (tmp_path / "hosts.yaml").write_text(hosts)
    (tmp_path / "groups.yaml").write_text(groups)
    with pytest.raises(ConfigError) as err:
        load_inventory([tmp_path])
    return err.value


def test_a_cycle_is_refused_naming_file_field_and_line(tmp_path):
    err = _refused(
        tmp_path, "groups:\n  a:\n    children: [b]\n  b:\n    children:\n      - c\n  c:\n    children: [a]\n"
    )
    assert err.details == {"source": str(tmp_path / "groups.yaml"), "field": "groups.c.children", "line": 8}
    assert "group cycle: a -> b -> c -> a" in str(err) and "(line 8)" in str(err)
    err = _refused(tmp_path, "groups:\n  a:\n    hosts: [h1]\n    children: [a]\n")
    assert "group cycle: a -> a" in str(err) and err.details["line"] == 4


def test_an_unknown_child_is_refused_with_a_suggestion(tmp_path):
    err = _refused(tmp_path, "groups:\n  rack-1:\n    hosts: [h1]\n  gpu:\n    children:\n      - rack-l\n")
    assert err.details == {"source": str(tmp_path / "groups.yaml"), "field": "groups.gpu.children", "line": 6}
    assert "unknown group 'rack-l'" in str(err) and "did you mean 'rack-1'" in str(err)
    err = _refused(tmp_path, "groups:\n  gpu:\n    children: [h1]\n")
    assert "it is a host: list it under hosts:" in str(err)


def test_an_unknown_member_host_is_refused_with_a_suggestion(tmp_path):
    err = _refused(tmp_path, "groups:\n  rack:\n    hosts:\n      h1:\n      h11:\n")
    assert err.details == {"source": str(tmp_path / "groups.yaml"), "field": "groups.rack.hosts", "line": 5}
    assert "unknown host 'h11'" in str(err) and "did you mean 'h1'" in str(err)


def test_a_name_that_is_both_a_host_and_a_group_is_refused(tmp_path):
    err = _refused(tmp_path, "groups:\n  x: {hosts: [h2]}\n  h1:\n    hosts: [h2]\n")
    assert err.details == {"source": str(tmp_path / "groups.yaml"), "field": "groups.h1", "line": 3}
    assert "host's name" in str(err)
    err = _refused(tmp_path, "hosts:\n  h3: {}\n", hosts="hosts:\n  hosts: {}\n  h2: {}\n")  # the stem 'hosts'
    assert err.details["field"] == "hosts" and "file name makes a group 'hosts'" in str(err)


def test_a_host_defined_in_two_files_is_still_refused_with_a_way_out(tmp_path):
    err = _refused(tmp_path, "hosts:\n  h1: {address: 127.0.0.2}\n")
    assert "also defined in" in str(err) and err.details["line"] == 2
    assert "groups:" in (err.hint or "")


@pytest.mark.parametrize(
    "groups,field,line,message",
    [
        ("groups: [a]\n", "groups", 1, "must be a mapping"),
        ("groups:\n  a: [h1]\n", "groups.a", 2, "not a list"),
        ("groups:\n  a:\n    hots: [h1]\n", "groups.a.hots", 3, "did you mean 'hosts'"),
        ("groups:\n  a:\n    hosts: h1\n", "groups.a.hosts", 3, "list of names"),
        ("groups:\n  a:\n    hosts:\n      h1: {user: x}\n", "groups.a.hosts.h1", 4, "top-level 'hosts:'"),
        ("groups:\n  'a,b':\n    hosts: [h1]\n", "groups.a,b", 2, "bad group name"),
        ("groups:\n  all:\n    hosts: [h1]\n", "groups.all", 2, "bad group name"),
    ],
)
def test_a_bad_groups_section_names_file_field_and_line(tmp_path, groups, field, line, message):
    err = _refused(tmp_path, groups)
    assert (err.details["field"], err.details["line"]) == (field, line) and message in str(err)


def test_a_host_may_not_set_its_own_groups(tmp_path):
    err = _refused(tmp_path, "hosts:\n  h3:\n    groups: [a]\n")
    assert err.details["field"] == "hosts.h3.groups" and "under the top-level 'groups:'" in str(err)


def test_the_raw_read_ignores_groups_sections(tmp_path):
    """Speculative connects read hosts only: a groups-only file changes nothing, a `groups:` group
    is never taken for a host (validation then resolves it)."""
    (tmp_path / "hosts.yaml").write_text("hosts:\n  h1: {address: 127.0.0.2}\n")
    (tmp_path / "groups.yaml").write_text("groups:\n  solo:\n    hosts: [h1]\n")
    assert raw_hosts("h1", [tmp_path]) == {
        "h1": {k: None for k in ("user", "port", "identity_file", "known_hosts", "proxy_jump")}
        | {"address": "127.0.0.2"}
    }
    assert raw_hosts("solo", [tmp_path]) is None


# -- the CLI ------------------------------------------------------------------------------------


def test_hosts_lists_what_a_pattern_names(tmp_path):
    inv = tmp_path / "inventory"
    inv.mkdir()
    (inv / "fleet.yaml").write_text(
        "hosts:\n" + "".join(f"  gpu-0{i}: {{address: 127.0.9.{i}}}\n" for i in range(1, 5))
    )
    (inv / "groups.yaml").write_text(
        "groups:\n  rack-2:\n    hosts: [gpu-02, gpu-03]\n  gpu:\n    children: [rack-2]\n"
    )
    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"), "REMOTE_OPS_INVENTORY": str(inv)}
    rc, out, err = run_cli(env, "hosts", "--host", "fleet:&rack-2:!gpu-03", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [h["name"] for h in doc["hosts"]] == ["gpu-02"]
    assert doc["hosts"][0]["groups"] == ["fleet", "gpu", "rack-2"]
    assert doc["groups"]["gpu"] == ["gpu-02", "gpu-03"] and doc["children"] == {
        "fleet": [],
        "rack-2": [],
        "gpu": ["rack-2"],
    }
    rc, out, _ = run_cli(env, "hosts", "--host", "fleet,&rack-2", "--limit", "!gpu-02", "--json")
    assert rc == 0 and [h["name"] for h in json.loads(out)["hosts"]] == ["gpu-03"]
    rc, out, err = run_cli(env, "hosts", "--host", "fleet:&rack-3")
    assert rc == 3 and "unknown host or group 'rack-3'" in err and "Traceback" not in err


def test_a_host_command_works_on_what_a_group_pattern_names(lab, lab_env, tmp_path):
    """Over the real lab sshd: `facts` on `gpu:!lab1`, gpu holding lab3 and, as a child, rack-a."""
    groups = tmp_path / "groups.yaml"
    groups.write_text(
        "groups:\n  rack-a:\n    hosts: [lab1, lab2]\n  gpu:\n    children: [rack-a]\n    hosts: [lab3]\n"
    )
    env = {**lab_env, "REMOTE_OPS_INVENTORY": os.pathsep.join([lab_env["REMOTE_OPS_INVENTORY"], str(groups)])}
    rc, out, err = run_cli(env, "facts", "--host", "gpu:!lab1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [h["host"] for h in doc["hosts"]] == ["lab2", "lab3"]
    assert all(h["result"]["host"] == h["host"] and h["result"]["os"] for h in doc["hosts"])


def test_inventory_check_lists_group_errors_and_the_schema_describes_groups(tmp_path):
    from remote_ops.cli.commands.inventory import file_problems, file_schema

    (tmp_path / "hosts.yaml").write_text("hosts:\n  h1: {}\n  h2:\n    groups: [a]\n")
    (tmp_path / "groups.yaml").write_text("groups:\n  a:\n    hots: [h1]\n")
    _, problems = file_problems(tmp_path / "hosts.yaml")
    assert [(p.field, p.line) for p in problems] == [("hosts.h2.groups", 4)]
    _, problems = file_problems(tmp_path / "groups.yaml")
    assert [(p.field, p.line) for p in problems] == [("groups.a.hots", 3)]
    schema = file_schema()
    assert set(schema["$defs"]["Group"]["properties"]) == {"hosts", "children"}
    # valid file by file, wrong as a whole: the cycle is found by loading everything
    (tmp_path / "hosts.yaml").write_text("hosts:\n  h1: {}\n")
    (tmp_path / "groups.yaml").write_text("groups:\n  a:\n    children: [b]\n  b:\n    children: [a]\n")
    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    rc, out, _ = run_cli(env, "inventory", "check", "--inventory", str(tmp_path), "--json")
    (error,) = json.loads(out)["errors"]
    assert rc == 3 and (error["field"], error["line"]) == ("groups.b.children", 5) and "a -> b -> a" in error["message"]


def test_the_shipped_example_has_a_group():
    inv = load_inventory([Path(__file__).resolve().parent.parent / "inventory"])
    assert inv.groups == {"rtx-pro-6000": ("gpu-node",)} and inv.hosts["gpu-node"].groups == ("rtx-pro-6000",)


def test_host_completion_completes_the_last_term_after_a_comma_or_a_colon(monkeypatch):
    """`--host` completion splits patterns as the selector does (',' and ':'), keeping `!`/`&`."""
    from remote_ops.cli.commands._options import complete_hosts

    class Ctx:
        params = {"inventory": None}

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the example inventory/
    values = lambda text: [c.value for c in complete_hosts(Ctx(), None, text)]  # noqa: E731
    assert values("gpu") == ["gpu-node"]
    assert values("fleet,!gpu") == ["fleet,!gpu-node"]
    assert values("gpu-node:&gp") == ["gpu-node:&gpu-node"]
    assert values("rtx:gpu") == ["rtx:gpu-node"]
