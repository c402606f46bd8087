"""benchmarks.compile_check: every kernel specialization compiles for sm_90 through ptxas, on this CPU machine.

The rest of the suite runs the kernels through the interpreter, which never meets the compiler; this runs the
real compiler in a subprocess (TRITON_INTERPRET unset) and checks what it produced.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import compile_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_specialization_compiles_for_sm90_with_vector_accesses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "--arch", "90", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile_check.json").read_text())
    assert report["failures"] == []
    compiled = report["compiled"]
    assert {c["kernel"] for c in compiled} == set(compile_check.KERNELS), "every kernel was compiled"
    assert report["launches"] >= len(compiled) > 50
    # the count docs/performance.md quotes (through docs/figures.json; `python -m benchmarks.figures --only`
    # records it again): it went stale once, when the segmented launches joined the cases
    recorded = json.loads((Path(REPO) / "docs" / "figures.json").read_text())["compile_check_specializations"]
    assert len(compiled) == recorded, (len(compiled), recorded)
    # ptxas ran: the cubins' resource usage was read, and nothing spills
    assert all(c["registers"] and c["local_bytes"] == 0 for c in compiled)
    assert all(isinstance(c["layout_converts"], int) for c in compiled)
    # the instrument tells the flatten kernel's two paths apart: 16-byte vector stores only where it may
    flat = [c for c in compiled if c["kernel"] == "flatten"]
    aligned = [c for c in flat if c["constexprs"]["ALIGNED"] == "True"]
    element_wise = [c for c in flat if c["constexprs"]["ALIGNED"] == "False"]
    assert len(element_wise) == 12  # 3 source dtypes x 2 out dtypes x accumulate
    # ... and aligned, with the one-block kernel from bf16 to bf16 beside the default four (session 37's A/B)
    assert len(aligned) == 13 and sorted(c["constexprs"]["BLOCKS"] for c in aligned).count("4") == 4, aligned
    # both directions: the stores were 16 bytes wide before 2026-11-30 while the loads were scalar
    assert all(16 in c["store_bytes"] and 16 in c["load_bytes"] for c in aligned)
    assert all(max(c["store_bytes"]) <= 4 for c in element_wise)
    # the optimizer updates read and write 16 bytes per instruction, also in the segmented launch over several
    # buckets (MULTI: its 2- and 4-byte accesses ran a 302M AdamW step at 55 % of the copy bandwidth, 2026-12-04)
    assert {c["kernel"] for c in compiled if c["constexprs"].get("MULTI") == "True"} == {"adamw", "sgd", "lion"}
    for c in compiled:
        if c["kernel"] in ("adamw", "sgd", "lion"):
            assert 16 in c["load_bytes"] and c["store_bytes"] == [16], c
    # stochastic rounding of bf16 AdamW states costs at most 1.3x the instructions per element of round-to-nearest
    # (issue 14.3b; it was 3.75x with a full Philox per element and state)
    def bf16_states(c, stochastic):
        k = c["constexprs"]
        return (c["kernel"] == "adamw" and k.get("exp_avg") == "bf16" and k.get("REMAINDER") == "False"
                and k.get("STOCHASTIC") == str(stochastic))
    nearest = [c["instructions_per_element"] for c in compiled if bf16_states(c, False)]
    stochastic = [c["instructions_per_element"] for c in compiled if bf16_states(c, True)]
    assert len(nearest) == len(stochastic) == 1
    assert stochastic[0] <= 1.3 * nearest[0], (stochastic, nearest)


def test_global_access_widths_are_read_off_ptx():
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.b16 %rs1, [ %rd2 ];
        @%p2 ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd3 ];
        st.global.v4.b32 [ %rd4 ], { %r1, %r2, %r3, %r4 };
        st.global.b16 [ %rd5 ], %rs1;
        ld.shared.v4.b32 { %r7, %r8, %r9, %r10 }, [ %r11 ];
        ld.param.u64 %rd6, [param_0];
    """
    assert compile_check.global_access_bytes(ptx) == {"ld": [2, 8, 16], "st": [2, 16]}


def test_problem_rules():
    ok = compile_check.problems("adamw", {}, 0, [16], [16])
    assert ok == []
    assert "spills" in compile_check.problems("adamw", {}, 64, [16], [16])[0]
    assert "16-byte" in compile_check.problems("scale", {}, 0, [4], [4])[0]
    assert compile_check.problems("scale_finalize", {}, 0, [4], [4]) == []
    assert compile_check.problems("flatten", {"ALIGNED": "False"}, 0, [2], [2]) == []
    assert "16-byte global store" in compile_check.problems("flatten", {"ALIGNED": "True"}, 0, [16], [2])[0]
    # each direction on its own: 16-byte stores do not excuse scalar loads
    assert "16-byte global load" in compile_check.problems("flatten", {"ALIGNED": "True"}, 0, [2, 8], [16])[0]
    assert "16-byte global load" in compile_check.problems("adamw", {}, 0, [4], [16])[0]
    # the read-only pass writes one partial per program: only its loads must be wide
    assert compile_check.problems("scale", {"WRITE": "False"}, 0, [16], [4]) == []
    assert "16-byte global store" in compile_check.problems("scale", {"WRITE": "True"}, 0, [16], [4])[0]


def test_ptx_instructions_are_counted():
    ptx = """
    .visible .entry k(
        .param .u64 k_param_0
    )
    {
        .reg .b32 %r<4>;
    $L__BB0_1:
        ld.param.u64 %rd1, [k_param_0];
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        add.s32 %r1, %r2, %r3;  // a comment
        @!%p2 bra $L__BB0_1;
        ret;
    }
    """
    assert compile_check.ptx_instruction_count(ptx) == 5


def test_the_coefficients_kernel_rule_sees_a_fused_multiply_add():
    """AdamW's coefficients kernel must round each float64 op as torch's ops do (its results are compared bit for
    bit with them): the check flags a fused multiply-add or an approximate op in its PTX, and the absence of the
    correctly rounded division and square root (the compiled kernel passes: the full check above)."""
    ok = "div.rn.f64 %rd1, %rd2, %rd3;\nsqrt.rn.f64 %rd4, %rd5;\nsub.rn.f64 %rd6, %rd7, %rd8;"
    assert compile_check.problems("adamw_coefficients", {}, 0, [8], [4], ok) == []
    fused = ok + "\nfma.rn.f64 %rd9, %rd1, %rd2, %rd3;"
    assert any("fused multiply-add" in p for p in compile_check.problems("adamw_coefficients", {}, 0, [8], [4], fused))
    approximate = "div.rn.f64 %rd1, %rd2, %rd3;\nsqrt.approx.f64 %rd4, %rd5;"
    assert len(compile_check.problems("adamw_coefficients", {}, 0, [8], [4], approximate)) == 2
