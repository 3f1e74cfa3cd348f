//! Benchmark result records.
//!
//! Every bench of the project writes one [`Record`]: which commit and CPU produced it, the command line, the
//! settings, and its cells. A cell carries its speed figures and, where the bench measures output quality, the
//! quality of the same outputs beside them, so no speed figure travels without the quality it was bought at. The
//! records that support the docs live under `docs/bench/results/`; `docs/bench/render.py` renders
//! `docs/performance.md` and the README's table from them, and CI fails when the rendered files are stale.
//!
//! The schema is versioned by [`SCHEMA`]; a field is added, never repurposed.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The schema name every record carries.
pub const SCHEMA: &str = "parse-record/1";

/// CPU flags that decide which kernels run; a record lists those the machine has.
const KERNEL_FLAGS: &[&str] = &[
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The machine a record was measured on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Host {
    /// `model name` of `/proc/cpuinfo` (or the OS's name for the CPU elsewhere).
    pub cpu: String,
    /// The kernel-relevant flags present, in [`KERNEL_FLAGS`] order.
    pub flags: Vec<String>,
    /// Logical CPUs available to the process.
    pub cpus: usize,
    /// `cpu family` and `model` of `/proc/cpuinfo`, where it has them (tells Zen generations apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family_model: Option<String>,
}

impl Host {
    /// This machine.
    pub fn current() -> Self {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Self::from_cpuinfo(&info)
    }

    /// Parses `/proc/cpuinfo` text (its first processor's block).
    pub fn from_cpuinfo(info: &str) -> Self {
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let have: Vec<&str> = field("flags")
            .map(|f| f.split_whitespace().map(String::from).collect::<Vec<_>>())
            .unwrap_or_default()
            .iter()
            .filter_map(|f| KERNEL_FLAGS.iter().find(|k| **k == f.as_str()).copied())
            .collect();
        let flags = KERNEL_FLAGS
            .iter()
            .filter(|k| have.contains(k))
            .map(|k| k.to_string())
            .collect();
        let family_model = match (field("cpu family"), field("model")) {
            (Some(f), Some(m)) => Some(format!("{f}/{m}")),
            _ => None,
        };
        Host {
            cpu: field("model name").unwrap_or_else(|| std::env::consts::ARCH.to_string()),
            flags,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            family_model,
        }
    }
}

/// How good the outputs behind a cell's speed figures were, on the same prompts in the same run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Quality {
    /// What is measured: `pass@1`, `exact answer`, `ROUGE-L vs target`, `tokens equal to target`, ...
    pub metric: String,
    /// The cell's value (a fraction where the metric is a share).
    pub value: f64,
    /// The reference mode's value on the same prompts, where the cell is compared with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<f64>,
    /// Problems scored.
    pub n: usize,
}

/// One measured configuration of a bench.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cell {
    /// What the cell is, e.g. `parse+token-spec, 8 clients`.
    pub label: String,
    /// Speed and work figures by name (`tokens_per_s`, `x_target`, `ms`, ...).
    pub figures: Map<String, Value>,
    /// The outputs' quality, where the bench measures it; `None` for benches whose outputs are fixed by
    /// construction (kernel timings over the same bits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<Quality>,
    /// Shown in the README's table.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub headline: bool,
}

impl Cell {
    pub fn new(label: impl Into<String>) -> Self {
        Cell {
            label: label.into(),
            figures: Map::new(),
            quality: None,
            headline: false,
        }
    }

    /// Adds a figure (non-finite values are written as `null`).
    pub fn figure(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.figures.insert(name.to_string(), value.into());
        self
    }

    pub fn quality(mut self, q: Quality) -> Self {
        self.quality = Some(q);
        self
    }

    pub fn headline(mut self) -> Self {
        self.headline = true;
        self
    }
}

/// One run of one bench.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Record {
    pub schema: String,
    /// The bench's name (`parse-bench`, `engine-bench`, `parsectl bench`, `fault-suite`, `gpu-bench`).
    pub bench: String,
    /// A title for the rendered section.
    pub title: String,
    /// `git rev-parse HEAD` where the bench ran (`PARSE_COMMIT` overrides; `unknown` outside a checkout).
    pub commit: String,
    /// Whether the tree had uncommitted changes.
    pub dirty: bool,
    /// Seconds since the Unix epoch when the record was written.
    pub unix_time: u64,
    pub host: Host,
    /// The command line, as run.
    pub command: String,
    pub settings: Value,
    pub cells: Vec<Cell>,
}

impl Record {
    /// A record of this process's run: commit, host and command line filled in.
    pub fn new(bench: &str, title: impl Into<String>, settings: Value) -> Self {
        let (commit, dirty) = commit();
        Record {
            schema: SCHEMA.to_string(),
            bench: bench.to_string(),
            title: title.into(),
            commit,
            dirty,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            host: Host::current(),
            command: command_line(),
            settings,
            cells: Vec::new(),
        }
    }

    pub fn push(&mut self, cell: Cell) {
        self.cells.push(cell);
    }

    /// Writes the record as pretty JSON, creating the parent folder.
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|source| Error::Json {
            path: path.display().to_string(),
            source,
        })?;
        std::fs::write(path, text + "\n").map_err(io)
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.display().to_string(),
            source,
        })
    }
}

fn commit() -> (String, bool) {
    if let Ok(c) = std::env::var("PARSE_COMMIT") {
        return (c, false);
    }
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            (c, dirty)
        }
        None => ("unknown".to_string(), false),
    }
}

fn command_line() -> String {
    let mut args = std::env::args();
    let program = args
        .next()
        .map(|p| {
            Path::new(&p)
                .file_name()
                .map_or(p.clone(), |f| f.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    std::iter::once(program)
        .chain(args.map(|a| {
            if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "'\"$`\\".contains(c)) {
                format!("'{}'", a.replace('\'', "'\\''"))
            } else {
                a
            }
        }))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_gives_the_model_the_kernel_flags_in_order_and_family() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                    model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_vnni sse avx2 fma avx512f f16c\n";
        let h = Host::from_cpuinfo(info);
        assert_eq!(h.cpu, "AMD EPYC 9R14");
        assert_eq!(h.flags, ["avx2", "fma", "f16c", "avx512f", "avx512_vnni"]);
        assert_eq!(h.family_model.as_deref(), Some("25/17"));
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let dir = std::env::temp_dir().join(format!("parse-record-{}", std::process::id()));
        let path = dir.join("r.json");
        let mut r = Record::new("test", "a test", serde_json::json!({"n": 3}));
        r.push(
            Cell::new("target")
                .figure("tokens_per_s", 12.5)
                .quality(Quality {
                    metric: "pass@1".into(),
                    value: 0.8,
                    reference: None,
                    n: 10,
                })
                .headline(),
        );
        r.push(Cell::new("kernel").figure("ms", 3.0));
        r.write(&path).unwrap();
        let back = Record::read(&path).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.schema, SCHEMA);
        assert!(back.cells[0].headline && !back.cells[1].headline);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
