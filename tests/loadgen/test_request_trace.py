"""Request traces: both formats, bad lines, tenant rules, and a tiny trace played against a
real kvd with every report file produced."""

from __future__ import annotations

import json

import pytest
import uvloop

from kvd_loadgen.data import data_dir
from kvd_loadgen.request_trace_report import write_report
from kvd_loadgen.request_trace import TraceRun, run_policy
from kvd_loadgen.trace_reader import TraceError, read_request_trace, tenant_rule


def test_both_formats_parse():
    mooncake = read_request_trace(
        data_dir() / "request-traces" / "mooncake_conversation_trace_head4000.jsonl", limit=50)
    assert len(mooncake) == 50 and mooncake[0].prompt_tokens == 6758
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(mooncake, mooncake[1:]))
    sample = read_request_trace(data_dir() / "request-traces" / "sample_request_trace.jsonl")
    assert {r.request_id for r in sample} >= {"interactive-1", "short"}
    assert next(r for r in sample if r.request_id == "short").output_tokens == 64


def test_a_limit_of_zero_reads_every_request(tmp_path):
    # `request-trace --limit 0` says "0: all"; it read one request.
    path = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}
    path.write_text("\n".join(json.dumps({**row, "timestamp": i}) for i in range(5)))
    assert len(read_request_trace(path, limit=0)) == 5
    assert len(read_request_trace(path, limit=2)) == 2


def test_bad_lines_are_errors_with_their_line_unless_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}
    path.write_text("\n".join([json.dumps(good), json.dumps({**good, "input_length": -3}),
                               "not json", json.dumps({"what": 1})]) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: input_length must be an integer >= 1"):
        read_request_trace(path)
    assert [r.line for r in read_request_trace(path, skip_bad=True)] == [1]


def test_tenant_rules(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": []}
            for i, n in enumerate((100, 20000, 5000))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_request_trace(path)
    assert [tenant_rule("length:10000")(r) for r in trace] == ["short", "long", "short"]
    assert [tenant_rule("round-robin:2")(r) for r in trace] == ["t1", "t0", "t1"]
    with pytest.raises(ValueError, match="unknown tenant rule"):
        tenant_rule("by-magic")


def test_a_tiny_trace_against_a_real_kvd_with_a_full_report(tmp_path):
    trace_path = data_dir() / "request-traces" / "mooncake_conversation_trace_head4000.jsonl"
    trace = read_request_trace(trace_path, limit=30)
    run = TraceRun(trace=str(trace_path), speed=200, limit=30, tenants="length:8000",
                   device_pages=200, host_pages=4000, max_output_tokens=20)
    results = [uvloop.run(run_policy(run, policy, trace)) for policy in ("lru", "fair")]
    for r in results:
        done = sum(c["finished"] + c["rejected"] for c in r["classes"])
        assert done == 30
        assert {c["tenant"] for c in r["classes"]} == {"short", "long"}
        assert r["tokens_per_s"] > 0 and r["occupancy"]
    report = write_report(tmp_path / "report", {"run": vars(run), "results": results})
    text = report.read_text()
    assert "| lru | short |" in text and "| fair | long |" in text
    for png in ("stall_cdf.png", "occupancy.png", "policies.png"):
        data = (tmp_path / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("argv, says", [
    (["request-trace", "/no/such/trace.jsonl"], "argument trace: no such file"),
    (["request-trace", __file__, "--speed", "0"], "argument --speed: must be more than 0"),
    (["whale-minnows", "--minnows", "-1"], "argument --minnows: must be more than 0"),
    (["disagg", "--decode-pages", "16"], "argument --decode-pages: must be at least"),
    (["bandwidth-hog", "--duration-s", "nan"], "argument --duration-s: must be a finite number"),
    (["soak", "--clients", "x"], "argument --clients: not a number"),
    (["request-trace", __file__, "--tenants", "round-robin:-1"],
     "argument --tenants: unknown tenant rule 'round-robin:-1'"),
    (["request-trace", __file__, "--model", "llama-4"], "argument --model: invalid choice"),
])
def test_a_bad_option_is_one_line_and_exit_2(argv, says, capsys):
    """Each of these ran into a traceback, some after a run's worth of time (ZeroDivision,
    KeyError, a negative token count sent to kvd, an AssertionError in the handoff burst)."""
    from kvd_loadgen.cli import main

    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_options_kvd_refuses_are_its_one_line_and_exit_2(capsys):
    """kvd says why in one line and exits 2; the load generator that started it said so with
    a traceback."""
    from kvd_loadgen.cli import main

    trace = data_dir() / "request-traces" / "sample_request_trace.jsonl"
    code = main(["request-trace", str(trace), "--device-pages", str(2**40), "--limit", "5",
                 "--policy", "lru"])
    assert code == 2
    err = capsys.readouterr().err
    assert "kvd-loadgen request-trace: kvd did not start: kvd: the pools need" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command, line, says", [
    ("request-trace", '{"timestamp": 1, "input_length": "x"}',
     ":1: input_length must be an integer >= 1, got 'x'"),
    ("request-trace", "not json", ":1: "),
    ("replay-intents", '{"step": null}', ":1: step must be an integer >= 0, got None"),
])
def test_a_trace_that_does_not_read_is_one_line_and_exit_2(command, line, says, tmp_path,
                                                            capsys):
    """A bad line of a trace file ended the load generator with a traceback."""
    from kvd_loadgen.cli import main

    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    assert main([command, str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvd-loadgen {command}: {trace}") and says in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_trace_name_that_is_no_file_or_profile_is_one_line_and_exit_2(capsys):
    """A misspelt profile ended replay-intents with a FileNotFoundError traceback, after the
    replays of the names before it."""
    from kvd_loadgen.cli import main

    assert main(["replay-intents", "balanced", "balancd", "--policy", "lru"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvd-loadgen replay-intents: no trace file or profile named "
                          "'balancd' (the profiles: balanced,")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
