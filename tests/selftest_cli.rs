//! `grpo selftest --device cpu`: every fused kernel (in f32, bf16 and f16), the training step, the
//! gradients and the generation of a tiny model against the CPU reference, and the offloaded optimiser
//! update against the update on the device, one table row each, all passing; a device that does not
//! open is a clear error.

mod common;

use predicates::str::contains;

#[test]
fn selftest_on_the_cpu_passes_every_check() {
    let out = common::grpo().args(["-q", "selftest", "--device", "cpu"]).assert().success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    println!("{text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.contains("  pass  ") || l.contains("  FAIL  ")).collect();
    for op in ["row_stats", "row_grad", "rms_norm", "rope", "masked_softmax", "flash_attention", "logprobs_entropy"] {
        for dtype in ["f32", "bf16", "f16"] {
            for part in ["fwd", "bwd"] {
                let has_bwd = !op.starts_with("row_");
                if part == "bwd" && !has_bwd {
                    continue;
                }
                let found =
                    rows.iter().any(|r| r.starts_with(&format!("{op} {part} ")) && r.contains(&format!(" {dtype} ")));
                assert!(found, "no row for {op} {part} {dtype}:\n{text}");
            }
        }
    }
    let model = ["train step loss", "train step grad norm", "model grads", "generation logit gap"];
    for check in model.into_iter().chain(["offloaded update weights", "offloaded update master"]) {
        assert!(rows.iter().any(|r| r.starts_with(check)), "no row for {check}:\n{text}");
    }
    assert!(rows.iter().all(|r| r.contains("  pass  ")), "a check failed:\n{text}");
    assert!(text.contains(&format!("{} checks, 0 failed", rows.len())), "{text}");
}

#[test]
fn an_unknown_device_is_a_clear_error() {
    common::grpo()
        .args(["-q", "selftest", "--device", "tpu"])
        .assert()
        .failure()
        .stderr(contains("unknown device `tpu`"));
}
