//! `grpo plot`: the training curves of run folders as a PNG.

mod common;

use std::path::Path;

/// Write a small run folder: `steps` metrics lines and a validation record at the last step.
fn fake_run(dir: &Path, steps: usize, reward_slope: f64) {
    std::fs::create_dir_all(dir.join("validation")).unwrap();
    let lines: Vec<String> = (1..=steps)
        .map(|s| {
            let reward = 0.2 + reward_slope * s as f64;
            format!(
                r#"{{"step":{s},"loss":{},"kl":{},"grad_norm":1.0,"learning_rate":1e-6,"reward":{reward},"clip_ratio":0.01,"entropy":0.9,"tokens_per_sec":250.0}}"#,
                1.0 / s as f64,
                0.001 * s as f64
            )
        })
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    let record = r#"{"bench":"aime24","id":"1","samples":[{"correct":true},{"correct":false}]}"#;
    std::fs::write(dir.join(format!("validation/step-{steps:08}-aime24.jsonl")), record).unwrap();
}

fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    let be = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (be(16), be(20))
}

#[test]
fn two_runs_on_one_figure_and_one_run_into_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("arm-a"), dir.path().join("arm-b"));
    fake_run(&a, 10, 0.02);
    fake_run(&b, 6, 0.05);
    let out = dir.path().join("compare.png");
    let ok = common::grpo().arg("plot").arg(&a).arg(&b).arg("-o").arg(&out).assert().success();
    assert!(String::from_utf8_lossy(&ok.get_output().stdout).contains("compare.png"));
    assert_eq!(png_size(&out), (1500, 1260));

    common::grpo().arg("plot").arg(&a).assert().success();
    assert_eq!(png_size(&a.join("curves.png")), (1500, 1260));

    let e = common::grpo().arg("plot").arg(&a).arg(&b).assert().failure();
    assert!(String::from_utf8_lossy(&e.get_output().stderr).contains("-o FILE.png"));
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = common::grpo().arg("plot").arg(&a).arg(&empty).arg("-o").arg(&out).assert().failure();
    assert!(String::from_utf8_lossy(&e.get_output().stderr).contains("not the output folder of a training run"));
    // A folder that does not exist is named as missing.
    let e = common::grpo().arg("plot").arg(dir.path().join("nothing")).assert().failure();
    let err = String::from_utf8_lossy(&e.get_output().stderr).to_string();
    assert!(err.contains("nothing: no such run folder") && !err.contains("metrics.jsonl"), "{err}");
}

#[test]
fn chosen_panels_from_a_metrics_file_beside_the_trainers() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("sft"), dir.path().join("off-grpo"));
    fake_run(&a, 4, 0.02);
    fake_run(&b, 4, 0.05);
    // A script's per-step held-out measure in one run folder (from step 0), none in the other.
    let heldout = "{\"step\":0,\"heldout/margin\":0.1}\n{\"step\":2,\"heldout/margin\":0.3}\n{\"step\":4,\"heldout/margin\":0.2}\n";
    std::fs::write(a.join("heldout.jsonl"), heldout).unwrap();
    let out = dir.path().join("seed.png");
    let plot = |panels: &str| {
        let mut c = common::grpo();
        c.arg("plot").arg(&a).arg(&b).args(["--metrics-file", "heldout.jsonl", "--panels", panels]).arg("-o").arg(&out);
        c
    };
    // Two metric panels and the validation's: one row of three.
    plot("heldout/margin,loss").assert().success();
    assert_eq!(png_size(&out), (1500, 460));
    // Four and the validation's: two rows.
    plot("heldout/margin,loss,reward,kl").assert().success();
    assert_eq!(png_size(&out), (1500, 860));
    // The default panels are the eight of metrics.jsonl.
    common::grpo()
        .arg("plot")
        .arg(&a)
        .arg(&b)
        .args(["--metrics-file", "heldout.jsonl", "-o"])
        .arg(&out)
        .assert()
        .success();
    assert_eq!(png_size(&out), (1500, 1260));
    // A folder with only the added file is drawn: it has per-step metrics.
    let c = dir.path().join("only-heldout");
    std::fs::create_dir(&c).unwrap();
    std::fs::write(c.join("heldout.jsonl"), heldout).unwrap();
    plot("heldout/margin").arg(&c).assert().success();
}
