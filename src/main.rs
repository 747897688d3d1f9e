use clap::Parser;

/// Counts allocations while a profile is recorded (`grpo bench train-step --profile`,
/// `train.profile_steps`); otherwise the system allocator behind one relaxed atomic load.
#[global_allocator]
static ALLOCATOR: grpo::profile::CountingAlloc = grpo::profile::CountingAlloc;

/// A training step frees and allocates tensors of tens of megabytes by the hundred. glibc serves large
/// blocks with fresh mmaps and hands freed memory back at once, so every step pays millions of page
/// faults to get it again; keep blocks up to 32 MiB in the heap and the heap's free memory for reuse.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 512 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() -> std::process::ExitCode {
    tune_allocator();
    grpo::cli::end_quietly_on_closed_pipe();
    let cli = grpo::cli::Cli::parse();
    grpo::cli::init_logging(cli.verbose, cli.quiet);
    match grpo::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", grpo::cli::error_message(&err));
            std::process::ExitCode::from(grpo::cli::exit_code(&err))
        }
    }
}
