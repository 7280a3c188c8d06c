//! The flag reference of docs/configuration.md, rendered from the clap definitions of every
//! kerf binary: `kerf-controller`, `kerf-kubelet-plugin` (and its `mps-control-daemon`
//! program) and the subcommands of `kerf`. A test compares the document with [`markdown`], so
//! a flag cannot change without its documentation.

use std::fmt::Write as _;

use clap::{Arg, ArgAction, Command, CommandFactory as _};

/// The line that starts the generated part of docs/configuration.md.
pub const BEGIN: &str =
    "<!-- BEGIN flags: generated from the clap definitions; see cli/src/reference.rs -->";
/// The line that ends it.
pub const END: &str = "<!-- END flags -->";

/// The commands documented, each with the heading it gets: every binary, and each
/// subcommand of `kerf` on its own.
fn commands() -> Vec<(String, Command)> {
    let mut commands = vec![
        (
            "kerf-controller".to_owned(),
            kerf_controller::args::Args::command(),
        ),
        (
            "kerf-kubelet-plugin".to_owned(),
            kerf_kubelet_plugin::args::Args::command(),
        ),
        (
            "kerf-kubelet-plugin mps-control-daemon".to_owned(),
            kerf_kubelet_plugin::args::mps_control_daemon_command(),
        ),
    ];
    let kerf = crate::args::Cli::command();
    for sub in kerf.get_subcommands() {
        commands.push((format!("kerf {}", sub.get_name()), sub.clone()));
    }
    commands
}

/// The generated part of docs/configuration.md, from [`BEGIN`] to [`END`] (both lines
/// included, ending with a newline).
pub fn markdown() -> String {
    let mut out = String::new();
    out.push_str(BEGIN);
    out.push('\n');
    for (title, command) in commands() {
        render_command(&mut out, &title, &command);
    }
    out.push('\n');
    out.push_str(END);
    out.push('\n');
    out
}

/// `text` with the generated part replaced by `generated`; `None` when `text` lacks the
/// [`BEGIN`] or [`END`] line.
pub fn splice(text: &str, generated: &str) -> Option<String> {
    let start = text.find(BEGIN)?;
    let end = start + text[start..].find(END)? + END.len();
    let end = if text[end..].starts_with('\n') {
        end + 1
    } else {
        end
    };
    Some(format!("{}{generated}{}", &text[..start], &text[end..]))
}

fn render_command(out: &mut String, title: &str, command: &Command) {
    let _ = writeln!(out, "\n## `{title}`\n");
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        let _ = writeln!(out, "{}\n", sentence(&about.to_string()));
    }
    out.push_str("| flag | environment variable | default | what |\n");
    out.push_str("|---|---|---|---|\n");
    for arg in command.get_arguments() {
        if matches!(arg.get_action(), ArgAction::Help | ArgAction::Version) {
            continue;
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            flag(arg),
            arg.get_env()
                .map_or_else(String::new, |env| format!("`{}`", env.to_string_lossy())),
            default(arg),
            cell(&help(arg)),
        );
    }
}

/// `` `--name <VALUE>` `` (or the short form too), as the user types it.
fn flag(arg: &Arg) -> String {
    let mut names = Vec::new();
    if let Some(short) = arg.get_short() {
        names.push(format!("-{short}"));
    }
    if let Some(long) = arg.get_long() {
        names.push(format!("--{long}"));
    }
    if names.is_empty() {
        names.push(arg.get_id().as_str().to_owned());
    }
    let mut text = names.join(", ");
    if arg.get_action().takes_values() {
        let value = arg.get_value_names().map_or_else(
            || arg.get_id().as_str().to_uppercase(),
            |names| {
                names
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            },
        );
        let _ = write!(text, " <{value}>");
    }
    format!("`{text}`")
}

fn default(arg: &Arg) -> String {
    if arg.is_required_set() {
        return "required".to_owned();
    }
    let values: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if values.is_empty() {
        String::new()
    } else {
        format!("`{}`", values.join(","))
    }
}

/// The flag's whole help text, and the values it accepts when clap knows them.
fn help(arg: &Arg) -> String {
    let mut text = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|help| sentence(&help.to_string()))
        .unwrap_or_default();
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set() && arg.get_action().takes_values())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    if !values.is_empty() {
        if !text.is_empty() {
            text.push(' ');
        }
        let _ = write!(text, "Values: {}.", values.join(", "));
    }
    text
}

/// Text on one line: paragraphs and line breaks become spaces.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text on one line that ends as a sentence does: clap drops the full stop of a one-paragraph
/// help text.
fn sentence(text: &str) -> String {
    let mut line = one_line(text);
    if !line.is_empty() && !line.ends_with(['.', '!', '?', ':']) {
        line.push('.');
    }
    line
}

/// Text for a table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    one_line(text).replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_replaces_only_the_generated_part() {
        let text = format!("# Title\n\nprose\n\n{BEGIN}\nold\n{END}\n\nmore prose\n");
        let new = format!("{BEGIN}\nnew\n{END}\n");
        assert_eq!(
            splice(&text, &new).as_deref(),
            Some(format!("# Title\n\nprose\n\n{BEGIN}\nnew\n{END}\n\nmore prose\n").as_str())
        );
        assert_eq!(splice("no markers", &new), None);
    }

    #[test]
    fn every_binary_and_subcommand_has_a_section() {
        let text = markdown();
        for title in [
            "`kerf-controller`",
            "`kerf-kubelet-plugin`",
            "`kerf-kubelet-plugin mps-control-daemon`",
            "`kerf demo`",
            "`kerf inventory`",
            "`kerf status`",
        ] {
            assert!(text.contains(&format!("\n## {title}\n")), "{title}");
        }
        assert!(
            text.contains(
                "| `--driver-name <DRIVER_NAME>` | `KERF_DRIVER_NAME` | `gpu.kerf.dev` |"
            )
        );
        assert!(!text.contains("`--help`"));
    }
}
