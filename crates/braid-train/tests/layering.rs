//! The module layering of braid-train and braid-model, read from their
//! sources: no module imports an item from a module above it (its parent
//! or another ancestor) except from the crate's root (`lib.rs`). What a
//! parent's children share lives in a sibling module the parent
//! re-exports (`engine/core.rs`, `collective/core.rs`, `model/gpt.rs`, …);
//! a child naming a sibling module through its parent
//! (`super::gpt_cpu::CpuGpt`) is fine. Test code (after a file's first
//! `#[cfg(test)]`, and modules declared `#[cfg(test)] mod x;`) and
//! comments (doc links) are not looked at.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `root`, by module path (`mod.rs` and `lib.rs`
/// stand for their folder's module).
fn modules(root: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("a source folder") {
            let p = entry.expect("an entry").path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            if p.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = p
                .strip_prefix(root)
                .expect("under the root")
                .with_extension("");
            let mut m: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            out.insert(m, p);
        }
    }
    out
}

/// The names of `m`'s child modules.
fn children(m: &[String], all: &BTreeMap<Vec<String>, PathBuf>) -> BTreeSet<String> {
    all.keys()
        .filter(|k| k.len() == m.len() + 1 && k[..m.len()] == *m)
        .map(|k| k[m.len()].clone())
        .collect()
}

/// `src` with its `//` and `/* */` comments blanked (string and char
/// literals kept whole, so that `"//"` is not taken for a comment).
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let end = src[i + 2..].find("*/").map_or(b.len(), |j| i + 2 + j + 2);
            out.extend(std::iter::repeat_n('\n', src[i..end].matches('\n').count()));
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.push_str(&src[i..end]);
            i = end;
        } else {
            let c = src[i..].chars().next().expect("a char");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Whether module `m`, or one above it, is declared `#[cfg(test)] mod
/// name;` in its parent's file.
fn test_only(m: &[String], all: &BTreeMap<Vec<String>, PathBuf>) -> bool {
    (1..=m.len()).any(|i| {
        let Some(parent) = all.get(&m[..i - 1]) else {
            return false;
        };
        let src = strip_comments(&std::fs::read_to_string(parent).expect("a source"));
        let decl = format!("mod {};", m[i - 1]);
        src.match_indices(&decl).any(|(at, _)| {
            let before = src[..at].trim_end();
            let before = before
                .strip_suffix("pub(crate)")
                .unwrap_or(before)
                .trim_end();
            before.ends_with("#[cfg(test)]")
        })
    })
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// What module `m`'s code (`body`) imports from the modules above it.
fn upward_imports(m: &[String], body: &str, all: &BTreeMap<Vec<String>, PathBuf>) -> Vec<String> {
    let mut bad = Vec::new();
    let parent = &m[..m.len() - 1];
    let siblings = children(parent, all);
    for (at, _) in body.match_indices("super::") {
        // Only the first `super::` of a path: what follows it names the
        // item or the module taken from the parent.
        if body[..at].ends_with("super::") {
            continue;
        }
        let mut rest = &body[at..];
        let mut ups = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
            ups += 1;
        }
        let ancestor = &m[..m.len() - ups.min(m.len())];
        if ancestor.is_empty() {
            continue; // the crate's root
        }
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(list) => list[..list.find('}').unwrap_or(list.len())]
                .split(',')
                .map(|n| n.trim())
                .filter(|n| !n.is_empty())
                .map(|n| if n.starts_with('*') { "*" } else { ident(n) })
                .collect(),
            None if rest.starts_with('*') => vec!["*"],
            None => vec![ident(rest)],
        };
        let shared = if ups == 1 {
            siblings.clone()
        } else {
            children(ancestor, all)
        };
        for n in names {
            if n != "self" && !shared.contains(n) {
                bad.push(format!("{}{n}", "super::".repeat(ups)));
            }
        }
    }
    for (at, _) in body.match_indices("crate::") {
        let path: Vec<&str> = body[at + "crate::".len()..]
            .split("::")
            .map(ident)
            .take_while(|s| !s.is_empty())
            .collect();
        // `crate::a::b::Item` where `a::b` is this module's ancestor.
        for k in 1..m.len() {
            if path.len() > k && path[..k] == m[..k] && !children(&m[..k], all).contains(path[k]) {
                bad.push(format!("crate::{}", path[..=k].join("::")));
            }
        }
    }
    bad
}

/// Every upward import in the crate whose sources are `src`.
fn scan(src: &Path) -> Vec<String> {
    let all = modules(src);
    let mut bad = BTreeSet::new();
    for (m, path) in &all {
        if m.is_empty() || test_only(m, &all) {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("a source");
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for import in upward_imports(m, &strip_comments(code), &all) {
            bad.insert(format!("{}: {import}", path.display()));
        }
    }
    bad.into_iter().collect()
}

#[test]
fn no_module_of_braid_train_or_braid_model_imports_one_above_it() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in [here.join("src"), here.join("../braid-model/src")] {
        // (The crates' modules are there to be read.)
        assert!(
            modules(&src).len() > 30,
            "{}: too few modules",
            src.display()
        );
        let bad = scan(&src);
        assert!(
            bad.is_empty(),
            "modules importing from a module above them (move what children share into a \
             sibling module the parent re-exports):\n{}",
            bad.join("\n")
        );
    }
}

#[test]
fn the_scan_sees_an_upward_import_and_lets_a_sibling_through() {
    let dir = std::env::temp_dir().join(format!("braid-layering-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("engines")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod engines;\n").unwrap();
    std::fs::write(
        src.join("engines/mod.rs"),
        "pub mod cpu;\npub mod gpu;\n#[cfg(test)]\nmod tests;\npub fn shared() {}\n",
    )
    .unwrap();
    // A sibling through the parent (fine), the root's item (fine), the
    // parent's own item (not), a glob of the parent (not), an ancestor's
    // item by a crate path (not); comments and test code are skipped.
    std::fs::write(
        src.join("engines/cpu.rs"),
        "use super::gpu::Gpu;\nuse crate::Root;\nuse super::shared;\nuse super::*;\n\
         fn f() { crate::engines::shared(); }\n// use super::in_a_comment;\n\
         #[cfg(test)]\nmod t { use super::super::shared; }\n",
    )
    .unwrap();
    std::fs::write(src.join("engines/gpu.rs"), "pub struct Gpu;\n").unwrap();
    std::fs::write(src.join("engines/tests.rs"), "use super::shared;\n").unwrap();
    let bad = scan(&src);
    std::fs::remove_dir_all(&dir).unwrap();
    let found: Vec<&str> = bad.iter().map(|b| b.rsplit(": ").next().unwrap()).collect();
    assert_eq!(
        found,
        vec!["crate::engines::shared", "super::*", "super::shared"],
        "{bad:?}"
    );
}
