//! `kerf`: kerf's command-line tool.
//!
//! Also a multi-call program: run under the name of one of the fake GPU tools
//! ([`kerf_fake_gpu_tools::TOOLS`]: `nvidia-smi`, `nvidia-cuda-mps-control`), as the links of
//! the mock driver root `kerf demo` installs, it is that fake tool. So the demo's plugin runs
//! real MPS daemon processes without a second binary to ship or find.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use kerf_cli::args::{Cli, Command, DemoArgs, InventoryArgs, StatusArgs, StatusOutput};
use kerf_cli::demo::manifests::ManifestSource;
use kerf_cli::demo::{self, DemoConfig};
use kerf_cli::status;
use kerf_kubelet_plugin::config::Discovery;

// mimalloc while the feature `mimalloc` (on by default) is on; why: `kerf_ops::allocator`.
kerf_ops::global_allocator!();

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if runs_as_fake_tool(&args) {
        // Before clap: the tools' arguments (`-d`, `-i <uuid> -c <mode>`) are not kerf's.
        std::process::exit(kerf_fake_gpu_tools::run(args, std::io::stdin()));
    }
    let result = match Cli::parse_from(args).command {
        Command::Inventory(args) => inventory(&args).map(|()| ExitCode::SUCCESS),
        Command::Demo(args) => run_demo(args),
        Command::Status(args) => run_status(&args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, joined by `: `, leaving out a cause whose text is already
/// in the message: kerf-cli's errors show their cause themselves (`reading FILE: <io error>`),
/// and printing the chain as well would say it twice.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// Whether the program was started under the file name of a fake GPU tool (argv\[0\]).
fn runs_as_fake_tool(args: &[OsString]) -> bool {
    args.first()
        .and_then(|program| Path::new(program).file_name())
        .is_some_and(|name| kerf_fake_gpu_tools::TOOLS.iter().any(|tool| name == *tool))
}

fn inventory(args: &InventoryArgs) -> anyhow::Result<()> {
    if args.list_profiles {
        for name in kerf_core::mock::profile_names() {
            println!("{name}");
        }
        return Ok(());
    }
    let source = kerf_kubelet_plugin::discovery::select(
        args.mock_gpus.as_deref(),
        args.mock_inventory.as_deref(),
    )?;
    let inventory = source.discover()?;
    let slices = kerf_cli::inventory::published_slices(
        &inventory,
        &args.driver_name,
        &args.node_name,
        &args.features(),
    )?;
    print!(
        "{}",
        kerf_cli::inventory::to_yaml(&slices).context("rendering YAML")?
    );
    Ok(())
}

fn run_status(args: &StatusArgs) -> anyhow::Result<()> {
    let driver = args.driver_name.as_str();
    let pool_label = args.node_pool_label.as_str();
    if !args.from.is_empty() {
        let snapshot = status::files::read(&args.from)?;
        let status = status::Status::with_pool_label(&snapshot, driver, pool_label);
        return print_status(&status, args.output);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = status_client(args).await?;
        if !args.watch {
            let snapshot = status::fetch(&client, driver).await?;
            let status = status::Status::with_pool_label(&snapshot, driver, pool_label);
            return print_status(&status, args.output);
        }
        let ctrl_c = async {
            // Without a SIGINT handler the default action (exit) is just as clean.
            let _ = tokio::signal::ctrl_c().await;
        };
        let output = args.output;
        status::watch(
            client,
            driver,
            pool_label,
            ctrl_c,
            |status| match output {
                // Clear the screen and home the cursor, as `watch(1)` does.
                StatusOutput::Table => print!("\x1b[2J\x1b[H{}", status::table(status)),
                StatusOutput::Json => match serde_json::to_string(status) {
                    Ok(line) => println!("{line}"),
                    Err(e) => eprintln!("error: encoding the status as JSON: {e}"),
                },
            },
            |error| eprintln!("warning: {error}"),
        )
        .await?;
        Ok(())
    })
}

fn print_status(status: &status::Status, output: StatusOutput) -> anyhow::Result<()> {
    match output {
        StatusOutput::Table => print!("{}", status::table(status)),
        StatusOutput::Json => println!("{}", status::json(status)?),
    }
    Ok(())
}

/// A client from `--kubeconfig`/`--context` when given, else kube's default (KUBECONFIG,
/// ~/.kube/config, in-cluster).
async fn status_client(args: &StatusArgs) -> anyhow::Result<kube::Client> {
    let options = kube::config::KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .context("loading the kubeconfig")?
        }
        None if args.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("loading the kubeconfig")?,
        None => kube::Config::infer()
            .await
            .context("finding a kubeconfig or in-cluster config")?,
    };
    kube::Client::try_from(config).context("creating the Kubernetes client")
}

fn run_demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log_filter).context("--log-filter")?,
        )
        .with_writer(std::io::stderr)
        .init();
    let output_dir = match args.output_dir {
        Some(dir) => dir,
        None => tempfile::Builder::new()
            .prefix("kerf-demo-")
            .tempdir()
            .context("creating the output directory")?
            .keep(),
    };
    let config = DemoConfig {
        output_dir,
        driver_name: args.driver_name,
        node_name: args.node_name,
        discovery: match args.mock_inventory {
            Some(path) => Discovery::MockFile(path),
            None => Discovery::MockProfile(args.mock_gpus),
        },
        classes: args
            .classes
            .map_or(ManifestSource::Embedded("admin"), ManifestSource::Dir),
        claims: args
            .claims
            .map_or(ManifestSource::Embedded("claims"), ManifestSource::Dir),
        run_containers: args.run_containers,
        busybox: args.busybox,
        // This very program, which is the fake tools under their names (see main).
        gpu_tools: Some(
            std::env::current_exe().context("finding the kerf binary for the fake GPU tools")?,
        ),
        mig_node: (!args.no_mig_node).then_some(demo::MigNode {
            name: args.mig_node_name,
            discovery: Discovery::MockProfile(args.mig_mock_gpus),
        }),
        shareable_node: (!args.no_shareable_node).then_some(demo::ShareableNode {
            name: args.shareable_node_name,
            discovery: Discovery::MockProfile(args.shareable_mock_gpus),
        }),
    };
    println!(
        "kerf demo — output directory: {}",
        config.output_dir.display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let summary = runtime.block_on(demo::run(&config))?;
    print!(
        "{}",
        demo::print::render_summary(&summary, config.run_containers)
    );
    Ok(if demo::print::failed(&summary) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error =
            anyhow::Error::from(kerf_cli::Error::io("reading", "/x.yaml", io)).context("--from");
        assert_eq!(error_text(&error), "--from: reading /x.yaml: no such file");
    }
}
