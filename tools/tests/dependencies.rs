//! The workspace's own crates agree on one version of every crate they depend on directly:
//! two versions of one crate (libloading 0.8 beside cudarc's 0.9) double its build and leave
//! two copies of its state in one process. Duplicates deep in other crates' trees (syn 2 and 3,
//! through proc macros) are theirs to resolve; `cargo tree -d` lists them.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// (name, version, from a registry, the names it depends on) of every package in Cargo.lock.
fn packages(lock: &str) -> Vec<(String, String, bool, Vec<String>)> {
    lock.split("[[package]]")
        .skip(1)
        .map(|block| {
            let field = |key: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{key} = \"")))
                    .map(|v| v.trim_end_matches('"').to_string())
            };
            let deps = block
                .split("dependencies = [")
                .nth(1)
                .map(|list| {
                    list.split(']')
                        .next()
                        .unwrap_or("")
                        .lines()
                        .filter_map(|l| l.trim().trim_end_matches(',').strip_prefix('"'))
                        .map(|d| d.trim_end_matches('"').split(' ').next().unwrap_or("").to_string())
                        .collect()
                })
                .unwrap_or_default();
            (
                field("name").unwrap_or_default(),
                field("version").unwrap_or_default(),
                field("source").is_some(),
                deps,
            )
        })
        .collect()
}

#[test]
fn direct_dependencies_have_one_version_each() {
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock")).unwrap();
    let all = packages(&lock);
    assert!(all.len() > 50, "Cargo.lock parsed: {} packages", all.len());
    let mut versions: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (name, version, _, _) in &all {
        versions.entry(name).or_default().insert(version);
    }
    let mut twice = Vec::new();
    for (name, _, registry, deps) in &all {
        if *registry {
            continue; // not one of ours
        }
        for dep in deps {
            let v = &versions[dep.as_str()];
            if v.len() > 1 {
                twice.push(format!(
                    "{name} -> {dep} ({})",
                    v.iter().copied().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    assert!(
        twice.is_empty(),
        "crates of ours depend on a crate that is locked at two versions:\n{}",
        twice.join("\n")
    );
}
