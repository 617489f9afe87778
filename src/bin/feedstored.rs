//! `feedstored`: the per-node daemon. Everything lives in `feedstore_store::cli`.

fn main() -> std::process::ExitCode {
    feedstore_store::cli::main()
}
