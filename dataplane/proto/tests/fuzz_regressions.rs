//! The fuzz harness `wire` (`fuzz/harness/wire.rs`) over every saved input in
//! `fuzz/regressions/wire/`: the seeds fuzzing starts from and every input that once crashed
//! it. Each must run clean.

#[path = "../fuzz/harness/wire.rs"]
mod harness;

#[test]
fn saved_fuzz_inputs_run_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/wire");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no saved inputs in {}", dir.display());
    for p in paths {
        let data = std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
        eprintln!("{}", p.display());
        harness::run(&data);
    }
}
