//! `bench/results` is a record with an index: every entry has a row in its
//! README (and every row an entry), no scripts live there, no file there
//! is one the repository's `.gitignore` excludes, and every
//! `bench/results/…` path the docs name exists. `braid scale --plot-only`
//! draws measured points (the plot of `bench/device/x4.sh scale`) with
//! round tick labels, through the real binary.

mod common;

use common::{braid, run, TempDir};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn results() -> PathBuf {
    repo().join("bench/results")
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The index's rows: each row's cells, the first reduced to the entry's
/// name (`[NAME](NAME)` or `` `NAME` ``; a folder ends in `/`).
fn index_rows() -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(results().join("README.md"))
        .unwrap_or_else(|e| panic!("bench/results/README.md, the index: {e}"));
    let mut rows = Vec::new();
    for line in text.lines().filter(|l| l.starts_with('|')) {
        // Cells split at `|` not escaped as `\|`.
        let mut cells = Vec::new();
        let mut cell = String::new();
        let mut chars = line.trim().trim_matches('|').chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if chars.peek() == Some(&'|') => cell.push(chars.next().unwrap()),
                '|' => cells.push(std::mem::take(&mut cell).trim().to_string()),
                _ => cell.push(c),
            }
        }
        cells.push(cell.trim().to_string());
        let first = &cells[0];
        if first == "entry" || first.starts_with("---") {
            continue;
        }
        let name = match first.strip_prefix('[') {
            Some(rest) => {
                let (name, target) = rest.split_once("](").unwrap_or_else(|| panic!("{line}"));
                assert_eq!(
                    target.trim_end_matches(')'),
                    name,
                    "the link of {name} points elsewhere"
                );
                name.to_string()
            }
            None => first.trim_matches('`').to_string(),
        };
        cells[0] = name;
        rows.push(cells);
    }
    rows
}

#[test]
fn every_result_has_a_row_in_the_index_and_every_row_an_entry() {
    let mut entries = BTreeSet::new();
    for e in std::fs::read_dir(results()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "README.md" {
            continue;
        }
        let slash = if e.path().is_dir() { "/" } else { "" };
        entries.insert(format!("{name}{slash}"));
    }
    let rows = index_rows();
    let mut named = BTreeSet::new();
    for r in &rows {
        assert!(named.insert(r[0].clone()), "{} has two rows", r[0]);
        assert_eq!(
            r.len(),
            5,
            "{}: expected entry | date | device | measured | command",
            r[0]
        );
        assert!(
            r[0].starts_with(&r[1]) && r[1].len() == 10,
            "{}: its date cell says {:?}",
            r[0],
            r[1]
        );
        for (k, what) in [(2, "device"), (3, "measured"), (4, "command")] {
            assert!(!r[k].is_empty(), "{}: no {what}", r[0]);
        }
    }
    let missing: Vec<_> = entries.difference(&named).collect();
    let stale: Vec<_> = named.difference(&entries).collect();
    assert!(
        missing.is_empty(),
        "entries of bench/results without a row in its README.md: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "rows of bench/results/README.md naming no entry (a folder's name ends in /): {stale:?}"
    );
}

#[test]
fn no_scripts_live_in_bench_results() {
    let scripts: Vec<_> = files_under(&results())
        .into_iter()
        .filter(|p| {
            let ext = p.extension().map(|e| e.to_string_lossy().into_owned());
            matches!(ext.as_deref(), Some("sh" | "py" | "bash"))
        })
        .collect();
    assert!(
        scripts.is_empty(),
        "scripts in bench/results (it is a record; scripts go to bench/device or bench/): {scripts:?}"
    );
}

#[test]
fn nothing_in_bench_results_is_a_file_git_ignores() {
    // The simple `*.EXT` patterns of the repository's .gitignore.
    let ignore = std::fs::read_to_string(repo().join(".gitignore")).unwrap();
    let suffixes: Vec<String> = ignore
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix('*'))
        .filter(|rest| rest.starts_with('.') && !rest.contains(['/', '*', '?', '[']))
        .map(str::to_string)
        .collect();
    assert!(
        suffixes.iter().any(|s| s == ".log"),
        "the .gitignore no longer names *.log: {suffixes:?}"
    );
    let ignored: Vec<_> = files_under(&results())
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            suffixes.iter().any(|s| name.ends_with(s.as_str()))
        })
        .collect();
    assert!(
        ignored.is_empty(),
        "files in bench/results that .gitignore excludes (keep text as .txt): {ignored:?}"
    );
    // Git's own view where git and the repository's .git are here.
    if !repo().join(".git").exists() {
        return;
    }
    let Ok(out) = Command::new("git")
        .args([
            "ls-files",
            "-ci",
            "--exclude-standard",
            "--",
            "bench/results",
        ])
        .current_dir(repo())
        .output()
    else {
        return;
    };
    if out.status.success() {
        let listed = String::from_utf8_lossy(&out.stdout);
        assert!(
            listed.trim().is_empty(),
            "tracked files under bench/results that .gitignore excludes:\n{listed}"
        );
    }
}

/// Whether `name` matches `pattern`, whose `*` stands for any run of
/// characters.
fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Whether a path named in the docs exists: `{a,b}` names both, `*` in
/// the last component matches any run of characters.
fn named_path_exists(root: &Path, path: &str) -> bool {
    if let (Some(open), Some(close)) = (path.find('{'), path.find('}')) {
        return path[open + 1..close].split(',').all(|alt| {
            named_path_exists(
                root,
                &format!("{}{alt}{}", &path[..open], &path[close + 1..]),
            )
        });
    }
    if !path.contains('*') {
        return root.join(path).exists();
    }
    let (dir, pattern) = path.rsplit_once('/').unwrap();
    std::fs::read_dir(root.join(dir)).is_ok_and(|rd| {
        rd.filter_map(Result::ok)
            .any(|e| glob_match(pattern, &e.file_name().to_string_lossy()))
    })
}

#[test]
fn every_bench_results_path_in_the_docs_exists() {
    let root = repo();
    let mut docs: Vec<PathBuf> = ["BENCHMARKS.md", "README.md", "ARCHITECTURE.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    docs.extend(files_under(&root.join("bench")));
    let mut broken = Vec::new();
    let mut seen = 0;
    for doc in docs {
        // Text files only (logs, scripts, docs); archives and images are skipped.
        let Ok(text) = std::fs::read_to_string(&doc) else {
            continue;
        };
        let mut rest = text.as_str();
        while let Some(i) = rest.find("bench/results/") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || "_.{},*/-".contains(c)))
                .unwrap_or(tail.len());
            let path = tail[..end].trim_end_matches(['.', ',']);
            rest = &tail[end..];
            // Placeholders (`bench/results/DATE-NAME/`) name no file.
            if path.contains("DATE") || path.contains("NAME") {
                continue;
            }
            seen += 1;
            if !named_path_exists(&root, path) {
                broken.push(format!(
                    "{}: {path}",
                    doc.strip_prefix(&root).unwrap().display()
                ));
            }
        }
    }
    assert!(
        seen > 40,
        "only {seen} bench/results paths found in the docs"
    );
    assert!(
        broken.is_empty(),
        "bench/results paths named but missing:\n{}",
        broken.join("\n")
    );
}

/// A tick label's value: 0, 0.5, 500, 1.5k, 250k, 1.2M.
fn tick_value(label: &str) -> f64 {
    let (num, scale) = match label.chars().last() {
        Some('k') => (&label[..label.len() - 1], 1e3),
        Some('M') => (&label[..label.len() - 1], 1e6),
        _ => (label, 1.0),
    };
    num.parse::<f64>()
        .unwrap_or_else(|_| panic!("tick label {label:?} is not a number"))
        * scale
}

/// The labels of an SVG's ticks drawn with `anchor` (`end`: the y axis,
/// `middle`: the x axis).
fn ticks(svg: &str, anchor: &str) -> Vec<f64> {
    svg.split("<text class=\"tick\"")
        .skip(1)
        .filter(|t| t[..t.find('>').unwrap()].contains(&format!("text-anchor=\"{anchor}\"")))
        .map(|t| tick_value(&t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()]))
        .collect()
}

#[test]
fn plot_only_draws_measured_points_with_round_ticks() {
    let dir = TempDir::new("plot-only");
    let tsv = dir.path().join("scaling.tsv");
    // What bench/device/x4.sh writes ($L/scaling.tsv), at 1, 2 and 4 GPUs.
    std::fs::write(
        &tsv,
        "series\tgpus\ttokens_per_s\tefficiency\n\
         braid\t1\t477216\t100.0%\n\
         braid\t2\t917807\t96.2%\n\
         braid\t4\t1795011\t94.0%\n\
         pytorch-ddp\t1\t333844\t100.0%\n\
         pytorch-ddp\t2\t647251\t96.9%\n\
         pytorch-ddp\t4\t1262000\t94.5%\n\
         pytorch-ddp-compile\t4\t1305524\t-\n",
    )
    .unwrap();
    let out = dir.path().join("plot");
    let mut cmd = braid();
    cmd.args(["scale", "--plot-only"])
        .arg(&tsv)
        .arg("--out")
        .arg(&out)
        .args(["--title", "124M <data parallel> & bf16"]);
    let f = run(cmd, Duration::from_secs(30));
    assert_eq!(f.code, Some(0), "{f:?}");
    let svg = std::fs::read_to_string(out.join("scaling.svg")).unwrap();
    assert!(
        svg.contains("124M &lt;data parallel&gt; &amp; bf16"),
        "{svg}"
    );
    for name in [
        ">braid<",
        ">pytorch-ddp<",
        ">pytorch-ddp-compile<",
        ">braid ideal (linear from 1 GPU)<",
    ] {
        assert!(svg.contains(name), "no {name} in\n{svg}");
    }
    // y: 0 and evenly spaced steps of 1, 2 or 5 times a power of ten, up
    // to the ideal line's top (4 x 477,216).
    let y = ticks(&svg, "end");
    assert!(y.len() >= 3 && y[0] == 0.0, "y ticks {y:?}");
    let step = y[1] - y[0];
    let mag = 10f64.powf(step.log10().floor());
    assert!(
        [1.0, 2.0, 5.0, 10.0]
            .iter()
            .any(|d| (step / mag - d).abs() < 1e-9),
        "y tick step {step} is not 1, 2 or 5 times a power of ten: {y:?}"
    );
    for (k, v) in y.iter().enumerate() {
        assert!(
            (v - k as f64 * step).abs() <= 1e-9 * step.max(1.0),
            "y ticks not evenly spaced: {y:?}"
        );
    }
    assert!(*y.last().unwrap() >= 4.0 * 477216.0, "y ticks {y:?}");
    // x: the GPU counts.
    assert_eq!(ticks(&svg, "middle"), [1.0, 2.0, 4.0], "x ticks");

    // A file without the columns is refused, naming what it expects.
    std::fs::write(&tsv, "name\tgpus\ttok\nbraid\t1\t5\n").unwrap();
    let mut cmd = braid();
    cmd.args(["scale", "--plot-only"])
        .arg(&tsv)
        .arg("--out")
        .arg(&out);
    let f = run(cmd, Duration::from_secs(30));
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("tokens_per_s"), "{}", f.stderr);
}
