//! Providers (who executes the work requests), doorbell handlers (who rings the doorbell) and
//! execution modes (who posts), and the one place where `auto` turns into a choice.
use std::fmt;
use std::str::FromStr;

use crate::system::RdmaDevice;

/// The HCA behind a context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// A ConnectX NIC through libmlx5 DevX.
    Mlx5,
    /// gdaki's software model of an mlx5 HCA (works with no NIC).
    Soft,
    /// mlx5 when an mlx5 RDMA device exists, else soft.
    Auto,
}

/// Who rings the doorbell for a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DoorbellHandler {
    /// The posting thread itself (GPU kernel or CPU thread) writes the doorbell record and the UAR
    /// (named `direct`, as the perftests say).
    #[serde(rename = "direct")]
    Gpu,
    /// The poster publishes its producer index; a CPU proxy thread rings for it. With the
    /// rings in host memory the proxy also writes the doorbell record; with them in GPU memory
    /// (where the CPU cannot write) the poster writes it and rings a host word as it would
    /// the UAR, and the proxy forwards that doorbell (CPU-assisted, as NVSHMEM's IBGDA does
    /// without gdrcopy).
    CpuProxy,
}

/// Who runs the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionMode {
    /// GPU kernels built from `gdaki-device`.
    Gpu,
    /// CPU threads running the same `gdaki-device` code.
    Cpu,
}

/// A resolved choice, with the reason in words (what `auto` logs and `doctor` prints).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Selection {
    /// Concrete provider (never `Auto`).
    pub provider: Provider,
    /// Doorbell handler.
    pub handler: DoorbellHandler,
    /// Execution mode.
    pub mode: ExecutionMode,
    /// Why, for humans.
    pub reason: String,
}

impl Selection {
    /// Resolves `requested` against what the machine has: the RDMA devices present and whether a
    /// usable GPU (driver, device and kernels) is there.
    pub fn resolve(requested: Provider, devices: &[RdmaDevice], gpu_usable: bool) -> Selection {
        let mlx5 = devices.iter().find(|d| d.mlx5);
        let (provider, mut reason) = match (requested, mlx5) {
            (Provider::Auto, Some(dev)) => (Provider::Mlx5, format!("mlx5 device {} found", dev.name)),
            (Provider::Auto, None) => (
                Provider::Soft,
                "no mlx5 RDMA device, using the software HCA".to_string(),
            ),
            (p, _) => (p, format!("{p} requested")),
        };
        let mode = if gpu_usable {
            ExecutionMode::Gpu
        } else {
            ExecutionMode::Cpu
        };
        reason.push_str(if gpu_usable {
            "; GPU present: kernels post"
        } else {
            "; no usable GPU: CPU threads post"
        });
        // The soft HCA's doorbell page is host-pinned memory any poster can write, and CPU
        // posters ring directly. Only mlx5 with a GPU poster depends on mapping the UAR into the
        // GPU, which is decided (and falls back to the CPU proxy) when a queue pair is created.
        let handler = DoorbellHandler::Gpu;
        if provider == Provider::Mlx5 && gpu_usable {
            reason.push_str("; GPU doorbell if the UAR maps into the GPU, else CPU proxy");
        }
        Selection {
            provider,
            handler,
            mode,
            reason,
        }
    }
}

/// A name that is not a provider, handler or mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {given:?} (expected one of: {expected})")]
pub struct UnknownName {
    kind: &'static str,
    given: String,
    expected: &'static str,
}

macro_rules! named {
    ($ty:ident, $kind:literal, $($variant:ident => $name:literal),+) => {
        impl $ty {
            /// The name used on command lines and in reports.
            pub const fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $ty {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(UnknownName { kind: $kind, given: s.to_string(), expected: concat!($($name, " "),+) }),
                }
            }
        }
    };
}
named!(Provider, "provider", Mlx5 => "mlx5", Soft => "soft", Auto => "auto");
named!(DoorbellHandler, "doorbell handler", Gpu => "direct", CpuProxy => "cpu-proxy");
named!(ExecutionMode, "mode", Gpu => "gpu", Cpu => "cpu");

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, mlx5: bool) -> RdmaDevice {
        RdmaDevice {
            name: name.into(),
            driver: String::new(),
            hca_type: String::new(),
            fw_ver: String::new(),
            mlx5,
            ports: vec![],
        }
    }

    #[test]
    fn auto_prefers_mlx5_then_soft() {
        let s = Selection::resolve(Provider::Auto, &[device("rxe0", false), device("mlx5_0", true)], true);
        assert_eq!((s.provider, s.mode), (Provider::Mlx5, ExecutionMode::Gpu));
        assert!(s.reason.contains("mlx5_0"), "{}", s.reason);
        let s = Selection::resolve(Provider::Auto, &[device("rxe0", false)], false);
        assert_eq!(
            (s.provider, s.mode, s.handler),
            (Provider::Soft, ExecutionMode::Cpu, DoorbellHandler::Gpu)
        );
    }

    #[test]
    fn names_round_trip_and_reject_others() {
        for p in [Provider::Mlx5, Provider::Soft, Provider::Auto] {
            assert_eq!(p.name().parse::<Provider>(), Ok(p));
        }
        assert_eq!("cpu-proxy".parse::<DoorbellHandler>(), Ok(DoorbellHandler::CpuProxy));
        let err = "mlx4".parse::<Provider>().unwrap_err();
        assert!(err.to_string().contains("mlx5 soft auto"), "{err}");
    }
}
