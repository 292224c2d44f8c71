"""The README's set-up commands are the ones CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)][:2]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = readme_commands()
    assert "geomx launch" in demo and "examples/train_cnn.py" in demo
    assert "pytest" in tests
    assert "torch==2.13.0" in demo and "torch==2.13.0" in tests


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = readme_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_readme_commands_install_from_the_pinned_constraints_and_ci_checks_style():
    demo, tests = readme_commands()
    assert "-c constraints.txt" in demo and "-c constraints.txt" in tests
    assert "ruff check geomx tests examples" in tests
    assert tests.index("ruff check") < tests.index("pytest"), "style is checked before the tests run"


def test_constraints_pin_every_dependency_of_the_package_and_its_extras():
    import tomllib

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [d for extra in ("test", "examples")
                                              for d in project["optional-dependencies"][extra]]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in wanted}
    assert names - pins.keys() == set(), f"unpinned: {sorted(names - pins.keys())}"
    assert pins["torch"] == "2.13.0", "the CPU build that lies on this machine's disk"


def test_the_readmes_topology_file_loads_as_it_is_printed(tmp_path):
    """A user copies it first: every key in it must exist and the settings must combine (it once asked for HFA
    in dist_async and named one place for two global servers)."""
    from geomx.cli.topology import load_topology

    text = (ROOT / "README.md").read_text()
    blocks = [block for block in re.findall(r"```toml\n(.*?)```", text, re.S) if "workers_per_dc" in block]
    assert blocks, "README.md: no topology file"
    path = tmp_path / "topo.toml"
    path.write_text(blocks[0])
    topo = load_topology(str(path))
    topo.validate()
    assert topo.dcs == 2 and topo.global_servers == 2
