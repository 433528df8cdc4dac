"""scripts/ncu_sass_stalls.py on a small SASS listing in the layout of `ncu --page source --csv
--print-source sass`: the samples by stall reason, by opcode (predicate and modifiers dropped)
and by phase add up, a bad file or phase is refused with the argument named."""
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_sass_stalls.py"

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_wait",
          "stall_long_sb", "stall_selected", "stall_wait (Not Issued)"]
ROWS = [  # address, source, samples, not issued, executed, wait, long_sb, selected, wait (n.i.)
    ["0x10", "      FFMA R24, R24, R19, R16", "10", "2", "1,000", "0", "0", "10", "0"],
    ["0x20", "      MUFU.EX2 R24, R24", "60", "50", "1000", "45", "5", "10", "45"],
    ["0x30", "@P1   MUFU.EX2 R25, R25", "20", "15", "1000", "15", "0", "5", "15"],
    ["0x40", "      HGMMA.64x72x16.F32 R88, R148, gdesc[UR4].tnspB, R88", "8", "6", "125", "6", "0", "2", "6"],
    ["0x50", "@!P0  BRA 0x7f37b77b4d30", "2", "2", "4000", "0", "2", "0", "0"],
]


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("ncu_sass_stalls", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows, kernel="gqa_flash_prefill"):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", kernel])
        w.writerow(HEADER)
        w.writerows(rows)
    return path


@pytest.fixture
def listing(tmp_path):
    return _write(tmp_path / "rep-sass.csv", ROWS)


def test_samples_add_up_by_reason_opcode_and_phase(script, listing):
    lines = script.read(listing)
    assert [x.opcode for x in lines] == ["FFMA", "MUFU", "MUFU", "HGMMA", "BRA"]
    assert lines[0].executed == 1000 and lines[1].stalls == {"wait": 45, "long_sb": 5, "selected": 10}
    doc = script.summary(lines, [script.parse_phase("exp2=1-2"), script.parse_phase("all=0-4")])
    assert doc["samples"] == 100 and doc["lines"] == 5
    assert list(doc["reasons"]) == ["wait", "selected", "long_sb"]  # most samples first
    assert doc["reasons"]["wait"] == {"samples": 66, "share": 0.66}
    mufu = doc["opcodes"]["MUFU"]
    assert (mufu["samples"], mufu["wait"], mufu["executed"]) == (80, 60, 2000)
    assert mufu["share"] == 0.8 and mufu["wait_share"] == 0.6
    assert list(doc["opcodes"])[0] == "MUFU"
    assert doc["phases"]["exp2"] == {"first": 1, "last": 2, "samples": 80, "share": 0.8}
    assert doc["phases"]["all"]["samples"] == 100
    assert [x.index for x in script.hot_lines(lines, 1000)] == [0, 1, 2, 4]


def test_the_cli_prints_and_writes_the_numbers(script, listing, tmp_path, capsys):
    out = tmp_path / "stalls.json"
    assert script.main([str(listing), "--phase", "exp2=1-2", "--lines", "2000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "100 samples over 5 SASS lines" in text
    assert "exp2" in text and "80.0 %" in text
    assert "BRA 0x7f37b77b4d30" in text and "MUFU.EX2 R24" not in text  # only lines run >= 2000 times
    doc = json.loads(out.read_text())
    assert doc["csv"] == str(listing) and doc["phases"]["exp2"]["samples"] == 80


@pytest.mark.parametrize("args,message", [
    (["--phase", "exp2"], "phase: expected NAME=FIRST-LAST"),
    (["--phase", "exp2=5-1"], "phase: expected NAME=FIRST-LAST"),
    (["--phase", "tail=3-9"], "phase: tail=3-9 is past the listing's last line 4"),
])
def test_a_bad_phase_is_named(script, listing, capsys, args, message):
    assert script.main([str(listing), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_not_a_sass_listing_is_named(script, tmp_path, capsys):
    other = tmp_path / "details.csv"
    other.write_text('"ID","Kernel Name","Metric Name"\n"0","k","Duration"\n')
    assert script.main([str(other)]) == 2
    assert "is not a SASS listing with warp stall sampling" in capsys.readouterr().err
    assert script.main([str(tmp_path / "missing.csv")]) == 2
    assert "csv: cannot read" in capsys.readouterr().err


def test_an_unwritable_json_path_is_named(script, listing, tmp_path, capsys):
    assert script.main([str(listing), "--json", str(tmp_path / "no" / "dir" / "x.json")]) == 2
    assert "--json: cannot write" in capsys.readouterr().err


OTHER_ROWS = [  # a second kernel: the same 2000 MUFU.EX2 in fewer samples, four times the FFMA, a MUFU.RCP
    ["0x10", "      FFMA R24, R24, R19, R16", "4", "1", "4,000", "0", "0", "4", "0"],
    ["0x20", "      MUFU.EX2 R24, R24", "30", "20", "2000", "20", "0", "10", "20"],
    ["0x30", "      MUFU.RCP R26, R26", "6", "6", "10", "6", "0", "0", "6"],
]


def test_two_listings_compare_per_unit_of_work(script, listing, tmp_path, capsys):
    other = _write(tmp_path / "other-sass.csv", OTHER_ROWS, kernel="other")
    c = script.compare(script.read(listing), script.read(other), script.parse_per("MUFU.EX2=2"))
    assert c["units"] == [1000.0, 1000.0]  # 2000 MUFU.EX2 in each, MUFU.RCP not counted
    assert c["samples"] == [100, 40]
    assert c["opcodes"]["MUFU"] == {"per_unit": [2.0, 2.01], "samples": [80, 36]}
    assert c["opcodes"]["FFMA"] == {"per_unit": [1.0, 4.0], "samples": [10, 4]}
    assert c["opcodes"]["HGMMA"]["per_unit"] == [0.125, 0.0]
    assert list(c["opcodes"])[0] == "MUFU"  # most samples in both first
    assert c["executed_per_unit"] == [7.125, 6.01]
    # by opcode without modifiers: every MUFU
    assert script.compare(script.read(listing), script.read(other),
                          script.parse_per("MUFU=1"))["units"] == [2000.0, 2010.0]
    # every stall reason in both, the most samples first; and one reason opcode by opcode
    assert c["reasons"] == {"wait": [66, 26], "selected": [27, 14], "long_sb": [7, 0]}
    w = script.compare(script.read(listing), script.read(other), script.parse_per("MUFU.EX2=2"),
                       ["wait", "long_sb"])["by_reason"]
    assert w["wait"] == {"MUFU": [60, 26], "HGMMA": [6, 0]}  # opcodes with none in either left out
    assert w["long_sb"] == {"MUFU": [5, 0], "BRA": [2, 0]}
    out = tmp_path / "c.json"
    assert script.main([str(listing), "--against", str(other), "--per", "MUFU.EX2=2", "--json", str(out),
                        "--reason", "wait"]) == 0
    text = capsys.readouterr().out
    assert "100 samples against 40 (2.500x)" in text and "a unit = 2 MUFU.EX2" in text
    assert "opcodes by 'wait' samples:" in text
    assert json.loads(out.read_text())["against"]["by_reason"]["wait"]["MUFU"] == [60, 26]


@pytest.mark.parametrize("args,message", [
    (["--per", "MUFU=66"], "--per and --against go together"),
    (["--against", "x.csv"], "--per and --against go together"),
    (["--per", "MUFU", "--against", "SELF"], "per: expected OPCODE=N"),
    (["--per", "MUFU=0", "--against", "SELF"], "per: expected OPCODE=N"),
    (["--per", "F2FP=32", "--against", "SELF"], "per: no F2FP was executed in this listing"),
    (["--reason", "wait"], "--reason compares two listings"),
    (["--per", "MUFU=1", "--against", "SELF", "--reason", "tex"], "reason: no stall reason 'tex'"),
])
def test_a_bad_comparison_is_named(script, listing, capsys, args, message):
    args = [str(listing) if a == "SELF" else a for a in args]
    assert script.main([str(listing), *args]) == 2
    assert message in capsys.readouterr().err
