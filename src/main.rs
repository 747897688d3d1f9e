use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = grpo::cli::Cli::parse();
    grpo::cli::init_logging(cli.verbose, cli.quiet);
    match grpo::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::from(1)
        }
    }
}
