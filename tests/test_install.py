"""How lowcomm installs: torch as a range (the fresh-machine pin and make test-install's torch
both inside it), Horovod as an extra at the release scripts/build_horovod.sh builds, and the
costly install test kept out of `make test` (it runs as `make test-install`)."""
import configparser
import re
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def requirements(section: str, key: str) -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [x.strip() for x in cfg[section][key].splitlines()]
    return {r.name: r for r in (Requirement(x) for x in lines if x and not x.startswith("#"))}


def pinned(path: Path, name: str) -> Version:
    (v,) = re.findall(rf"^{name}==(\S+)$", path.read_text(), re.M)
    return Version(v)


def test_torch_is_a_range_holding_the_pin_and_the_install_tests_torch():
    torch_req = requirements("options", "install_requires")["torch"]
    assert not any(s.operator in ("==", "===") for s in torch_req.specifier), torch_req
    pin = pinned(ROOT / "constraints" / "fresh-machine.txt", "torch")
    (other,) = re.findall(r"^TEST_TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert Version(other) != pin
    for v in (pin, Version(other), Version(torch.__version__.split("+")[0])):
        assert torch_req.specifier.contains(v), f"torch {v} outside {torch_req}"
    assert 'pipq install -c "$PINS"' in (ROOT / "scripts" / "bootstrap.sh").read_text()


def test_horovod_is_an_extra_at_the_release_the_build_script_builds():
    (req,) = requirements("options.extras_require", "horovod").values()
    (built,) = re.findall(r"^HOROVOD_VERSION=(\S+)$",
                          (ROOT / "scripts" / "build_horovod.sh").read_text(), re.M)
    assert str(req.specifier) == f"=={built}"
    assert "horovod" not in requirements("options", "install_requires")


def test_make_test_does_not_run_the_install_test():
    make = (ROOT / "Makefile").read_text()
    (test_rule,) = re.findall(r"^test:(.*)\n((?:\t.*\n)+)", make, re.M)
    assert "test-install" not in "".join(test_rule) and "test_install" not in "".join(test_rule)
    assert re.search(r"^test-install:.*\n\t.*scripts/test_install\.sh", make, re.M)
