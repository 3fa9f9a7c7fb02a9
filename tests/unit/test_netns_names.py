"""Pure parts of tools.netns: the names a lab gives its namespaces, and the host names it accepts."""

from __future__ import annotations

import pytest

from tools.netns import LAB_PREFIX, NetLab, lab_pid


@pytest.mark.parametrize(("name", "pid"), [
    (f"{LAB_PREFIX}-4242-a1b2c3-switch", 4242),
    (f"{LAB_PREFIX}-7-a1b2c3-w1", 7),
    (f"{LAB_PREFIX}-99-beef-probe", 99),
    (f"{LAB_PREFIX}-x1-a1b2c3-w1", None),  # no pid
    (f"{LAB_PREFIX}-4242", None),  # too short to be a lab's
    ("fleetfault4242", None),  # test_faults' namespace: not a lab's
    ("otherlab-4242-a1b2c3-w1", None),
])
def test_lab_pid_reads_the_pid_of_a_labs_namespace_only(name: str, pid: int | None) -> None:
    assert lab_pid(name) == pid


def test_a_lab_names_its_namespaces_after_its_process() -> None:
    lab = NetLab()
    assert lab_pid(lab.switch) is not None and lab.switch.endswith("-switch")
    assert lab.tag != NetLab().tag  # two labs of one process never share names


@pytest.mark.parametrize("bad", ["", "w-1", "w 1", "averylonghost"])
def test_a_host_name_must_be_short_letters_and_digits(bad: str) -> None:
    with pytest.raises(ValueError, match="letters and digits only, at most 10 characters"):
        NetLab().add(bad)  # refused before any namespace is made
