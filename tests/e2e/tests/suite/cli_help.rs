//! What a Kubernetes user reads first: `--help`. Every command and flag of
//! `otter` and `otter-agent` says what it is for.

use clap::CommandFactory;

/// The commands and arguments under `cmd` (by path) with no help text.
fn undocumented(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
    let here = format!("{path} {}", cmd.get_name()).trim().to_owned();
    if !path.is_empty() && cmd.get_about().is_none() && cmd.get_long_about().is_none() {
        missing.push(here.clone());
    }
    for arg in cmd.get_arguments() {
        let builtin = matches!(arg.get_id().as_str(), "help" | "version");
        if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
            missing.push(format!("{here} {}", arg.get_id()));
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            undocumented(sub, &here, missing);
        }
    }
}

#[test]
fn every_command_and_flag_has_help() {
    let mut missing = Vec::new();
    undocumented(&otter_hub::cli::Cli::command(), "", &mut missing);
    undocumented(&otter_agent::cli::Cli::command(), "", &mut missing);
    assert!(missing.is_empty(), "without help: {missing:#?}");
}
