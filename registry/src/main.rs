//! `amber-registry`: serve the registry, check its storage, or import images into it.

mod import_cmd;

use clap::{Parser, Subcommand};

use amber_registry::config::ConfigArgs;

/// jemalloc rather than glibc's malloc: under 64 concurrent catalog reads right after an
/// ingest, glibc's arena locks and `malloc_consolidate` took about 40% of the registry's
/// CPU (catalog pages 6,800 req/s with glibc, 18,600 with jemalloc, at 20,000 images).
/// mimalloc was as fast but peaked at 2.2 GiB resident during that ingest (a heap per
/// blocking thread, up to 167 of them), against 260 MiB with jemalloc and 190 with glibc.
///
/// Unprefixed: jemalloc is `malloc` for the whole process, RocksDB's and zstd's C and C++
/// allocations included. At a million images nearly every RocksDB lookup allocates and
/// frees a block, and glibc's arenas (two, behind locks) held more: after the same reads of
/// a million-image store the registry held 274-278 MiB resident instead of 331, and a
/// 100,000-image ingest with conversion peaked at 439 MiB instead of 450 (ingest 491 s
/// against 500; BENCHMARKS.md, "Memory: one allocator for the whole process").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "amber-registry",
    version,
    about = "amber's OCI registry of execution environments"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OCI Distribution API and the amber API.
    Serve(ConfigArgs),
    /// Verify every stored object's hash and the index against the store; changes nothing
    /// unless --repair is given.
    Fsck {
        #[command(flatten)]
        config: ConfigArgs,
        /// Remove unreferenced partial data (staged uploads of no session); nothing else.
        #[arg(long)]
        repair: bool,
    },
    /// Rebuild the index from the object store alone (new replica, lost index).
    Reindex(ConfigArgs),
    /// Write every record of a local-disk store (kept in `<data>/store/_records.db`) as a
    /// file named by its key under --into: with the store's other directories copied
    /// beside them, the layout of an S3 store, which a replica over that bucket reindexes
    /// and serves. Reads a snapshot: the registry may be running.
    ExportRecords {
        /// The registry's data directory.
        #[arg(long)]
        data: std::path::PathBuf,
        /// Where the record files go (`<into>/_records/…`).
        #[arg(long)]
        into: std::path::PathBuf,
    },
    /// Copy images from other OCI registries into a running amber registry.
    Import(import_cmd::ImportArgs),
    /// Add accounts to the users file (a running registry picks them up).
    #[command(subcommand)]
    User(UserCommand),
}

#[derive(Subcommand)]
enum UserCommand {
    /// Add or replace a user; the password is the first line of standard input.
    Add {
        name: String,
        /// The users file.
        #[arg(long, env = "AMBER_USERS")]
        users: std::path::PathBuf,
        /// Repository prefix the user may pull (repeat; `*` for all).
        #[arg(long)]
        pull: Vec<String>,
        /// Repository prefix the user may push and pull (repeat).
        #[arg(long)]
        push: Vec<String>,
    },
    /// Add or replace a pull-only robot for runners; prints its new token once.
    Robot {
        name: String,
        #[arg(long, env = "AMBER_USERS")]
        users: std::path::PathBuf,
        /// Repository prefix the robot may pull (repeat; `*` for all).
        #[arg(long, required = true)]
        pull: Vec<String>,
    },
}

/// Logs to standard error through a writer thread: a request's line is formatted on its
/// worker and queued, and the thread writes what is queued in one call when the queue
/// runs dry (one write(2) per line on the workers was 18% of the CPU of a GET by tag at a
/// million images). A full queue makes loggers wait: lines are never dropped, and the
/// queue stays small (`LOG_QUEUE_LINES`). Colours only on a terminal. The guard flushes
/// what is queued when dropped.
fn init_logs() -> tracing_appender::non_blocking::WorkerGuard {
    use std::io::IsTerminal;
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("amber-log")
        .finish(std::io::BufWriter::new(std::io::stderr()));
    let filter = tracing_subscriber::EnvFilter::try_from_env("AMBER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(writer);
    if std::env::var("AMBER_LOG_FORMAT").as_deref() == Ok("json") {
        fmt.json().init();
    } else {
        fmt.init();
    }
    guard
}

/// Lines the log writer's queue holds before loggers wait: about 8 MiB of request lines,
/// a second of them at 30,000 requests a second. The library's default (128,000) let a
/// writer thread short of CPU under a read load hold tens of MiB (peak RSS 433 MiB instead
/// of 380-391 at a million images); 8,192 measured the same RSS as this and no less CPU.
const LOG_QUEUE_LINES: usize = 32768;

fn main() -> std::process::ExitCode {
    let logs = init_logs();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("starting the tokio runtime");
    let result = runtime.block_on(run(Cli::parse()));
    // `serve` has stopped the background work (conversions end at their next read or
    // chunk write); what is left are tasks of no consequence, dropped here.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    // What was logged is written before anything else is said.
    drop(logs);
    let code = result.unwrap_or_else(|e| {
        eprintln!("amber-registry: {e:#}");
        std::process::ExitCode::FAILURE
    });
    if amber_registry::index::Index::open_count() > 0 {
        // A blocking task still holds the index or the fs store's records: `exit` would
        // run RocksDB's static destructors under it. What it wrote is in the OS already
        // (the write-ahead log is written on every write); end without the destructors.
        eprintln!(
            "amber-registry: a background task did not stop; exiting without closing the index"
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: `_exit` ends the process at once; nothing after it runs.
        unsafe { libc::_exit(1) }
    }
    code
}

async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    match cli.command {
        Command::Serve(args) => {
            let config = args.resolve()?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .map_err(|e| anyhow::anyhow!("binding {}: {e}", config.listen))?;
            let reg = amber_registry::registry::open(config).await?;
            amber_registry::server::serve(reg, listener).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Import(args) => import_cmd::run(args).await,
        Command::ExportRecords { data, into } => {
            let n = tokio::task::spawn_blocking(move || {
                amber_registry::store::fs_records::RecordDb::read_only(&data.join("store"))?
                    .export_files(&into)
            })
            .await??;
            println!("exported {n} records");
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Reindex(args) => {
            let metrics = amber_registry::metrics::install();
            let s = amber_registry::reindex::reindex(args.resolve()?).await?;
            let requests = amber_registry::metrics::s3_requests(&metrics);
            if !requests.is_empty() {
                let total: u64 = requests.iter().map(|(_, n)| n).sum();
                let each: Vec<String> =
                    requests.iter().map(|(op, n)| format!("{op} {n}")).collect();
                println!("S3 requests: {total} ({})", each.join(", "));
            }
            println!(
                "reindexed {} manifests, {} blobs, {} tags, {} conversions, {} chunks",
                s.manifests, s.blobs, s.tags, s.conversions, s.chunks
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::User(cmd) => {
            use amber_registry::auth::{hash_secret, Account, UsersFile};
            let (path, account, token) = match cmd {
                UserCommand::Add {
                    name,
                    users,
                    pull,
                    push,
                } => {
                    let mut password = String::new();
                    std::io::stdin().read_line(&mut password)?;
                    let password = password.trim_end_matches(['\r', '\n']);
                    anyhow::ensure!(!password.is_empty(), "no password on standard input");
                    let account = Account {
                        name,
                        password: hash_secret(password),
                        pull,
                        push,
                        robot: false,
                    };
                    (users, account, None)
                }
                UserCommand::Robot { name, users, pull } => {
                    let token = format!(
                        "amber_{}{}",
                        uuid::Uuid::new_v4().simple(),
                        uuid::Uuid::new_v4().simple()
                    );
                    let account = Account {
                        name,
                        password: hash_secret(&token),
                        pull,
                        push: Vec::new(),
                        robot: true,
                    };
                    (users, account, Some(token))
                }
            };
            anyhow::ensure!(
                !account.name.is_empty() && !account.name.contains(':'),
                "a user name may not be empty or contain ':'"
            );
            let mut file = UsersFile::load(&path)?;
            let name = account.name.clone();
            file.upsert(account);
            file.save(&path)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            match token {
                Some(t) => println!("{t}"),
                None => eprintln!("user {name} saved in {}", path.display()),
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Fsck { config, repair } => {
            let reg = amber_registry::registry::open(config.resolve()?).await?;
            let (checked, problems) = amber_registry::fsck::check(&reg).await?;
            for p in &problems {
                println!("problem: {p}");
            }
            println!("checked {checked} objects, {} problems", problems.len());
            if repair {
                let removed = amber_registry::fsck::repair(&reg, &problems).await?;
                for r in &removed {
                    println!("removed: {r}");
                }
                println!("repaired {} of {} problems", removed.len(), problems.len());
                let left = problems.len() - removed.len();
                return Ok(if left == 0 {
                    std::process::ExitCode::SUCCESS
                } else {
                    std::process::ExitCode::FAILURE
                });
            }
            Ok(if problems.is_empty() {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            })
        }
    }
}
