//! `grpo data stats` and `grpo data prepare`.

#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {}

pub fn run(cmd: DataCommand) -> anyhow::Result<()> {
    match cmd {}
}
