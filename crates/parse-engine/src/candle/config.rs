//! Where and how an engine computes: `--backend kernels|candle`, `--device cpu|cuda:N`.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::error::{Error, Result};

/// Which model implementation runs the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The engine's own CPU kernels (batch-invariant, the CPU default).
    #[default]
    Kernels,
    /// The model on candle tensors, on any device candle was built for.
    Candle,
}

impl FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernels" => Ok(Backend::Kernels),
            "candle" => Ok(Backend::Candle),
            other => Err(Error::invalid(format!(
                "unknown backend `{other}`: use kernels or candle"
            ))),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Kernels => "kernels",
            Backend::Candle => "candle",
        })
    }
}

/// A compute device: the CPU, or CUDA device N.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "cpu" {
            return Ok(DeviceSpec::Cpu);
        }
        if s == "cuda" {
            return Ok(DeviceSpec::Cuda(0));
        }
        match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
            _ => Err(Error::invalid(format!(
                "unknown device `{s}`: use cpu or cuda:N (N the GPU's ordinal)"
            ))),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Opens the device. CUDA fails with a clear error on a build without the `cuda` feature or on a host where
    /// the device cannot be opened.
    pub fn open(&self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(Error::invalid(format!(
                        "device cuda:{n} asked for, but this binary was built without CUDA (cargo feature `cuda`)"
                    )));
                }
                Device::new_cuda(*n)
                    .map_err(|e| Error::invalid(format!("cannot open CUDA device {n}: {e}")))
            }
        }
    }
}

/// The backend and the device together, as a worker's flags give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Compute {
    pub backend: Backend,
    pub device: DeviceSpec,
}

impl Compute {
    /// Resolves the flags: a CUDA device implies the candle backend (the kernel model computes only on the CPU);
    /// `--backend kernels` with a CUDA device is refused. `backend: None` means the flag was not given.
    pub fn resolve(backend: Option<Backend>, device: DeviceSpec) -> Result<Self> {
        let backend = match (backend, device) {
            (Some(Backend::Kernels), DeviceSpec::Cuda(n)) => {
                return Err(Error::invalid(format!(
                    "the kernels backend computes on the CPU only; cuda:{n} needs --backend candle (or no --backend)"
                )));
            }
            (Some(b), _) => b,
            (None, DeviceSpec::Cuda(_)) => Backend::Candle,
            (None, DeviceSpec::Cpu) => Backend::Kernels,
        };
        Ok(Compute { backend, device })
    }

    /// The kernel model on the CPU.
    pub fn is_kernels(&self) -> bool {
        self.backend == Backend::Kernels
    }
}

impl fmt::Display for Compute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}", self.backend, self.device)
    }
}

/// `--backend` and `--device`, as every worker and `parsectl generate --local` take them.
#[cfg(feature = "clap")]
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ComputeArgs {
    /// Model implementation: `kernels` (the engine's CPU kernels; the CPU default) or `candle` (candle tensors, on
    /// the CPU or a GPU) [default: kernels on the CPU, candle on a GPU].
    #[arg(long, env = parse_core::env::BACKEND, value_parser = parse_backend)]
    pub backend: Option<Backend>,
    /// Where the model computes: `cpu` or `cuda:N` (N the GPU's ordinal; implies --backend candle).
    #[arg(long, env = parse_core::env::DEVICE, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceSpec,
}

#[cfg(feature = "clap")]
fn parse_backend(s: &str) -> std::result::Result<Backend, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

#[cfg(feature = "clap")]
fn parse_device(s: &str) -> std::result::Result<DeviceSpec, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

#[cfg(feature = "clap")]
impl ComputeArgs {
    /// The resolved choice (see [`Compute::resolve`]).
    pub fn compute(&self) -> Result<Compute> {
        Compute::resolve(self.backend, self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_resolve_and_bad_ones_are_refused() {
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(1));
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        for bad in ["gpu", "cuda:x", "cuda:", "CPU"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        assert!("torch".parse::<Backend>().is_err());
        let c = Compute::resolve(None, DeviceSpec::Cuda(0)).unwrap();
        assert_eq!(c.backend, Backend::Candle);
        assert!(
            Compute::resolve(None, DeviceSpec::Cpu)
                .unwrap()
                .is_kernels()
        );
        let c = Compute::resolve(Some(Backend::Candle), DeviceSpec::Cpu).unwrap();
        assert_eq!(c.to_string(), "candle on cpu");
        let err = Compute::resolve(Some(Backend::Kernels), DeviceSpec::Cuda(0)).unwrap_err();
        assert!(err.to_string().contains("--backend candle"), "{err}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cuda_device_without_the_feature_is_a_clear_error() {
        let err = DeviceSpec::Cuda(0).open().unwrap_err();
        assert!(err.to_string().contains("without CUDA"), "{err}");
    }
}
