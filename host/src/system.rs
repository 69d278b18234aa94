//! What this machine offers gdaki, read without linking anything: RDMA devices from sysfs
//! (`/sys/class/infiniband`, the same source `ibv_devinfo` reads), the verbs libraries by
//! `dlopen`, and the GPU-memory registration paths (dma-buf, the `nvidia_peermem` module).
use std::fs;
use std::path::{Path, PathBuf};

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RdmaPort {
    /// Port number (1-based).
    pub number: u32,
    /// State, e.g. `ACTIVE`, `DOWN` (the text after `4: ` in sysfs).
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Rate as sysfs reports it, e.g. `200 Gb/sec (4X HDR)`.
    pub rate: String,
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RdmaDevice {
    /// Device name, e.g. `mlx5_0`.
    pub name: String,
    /// Kernel driver bound to its PCI function, e.g. `mlx5_core`.
    pub driver: String,
    /// HCA type, e.g. `MT4129`.
    pub hca_type: String,
    /// Firmware version.
    pub fw_ver: String,
    /// Whether gdaki's mlx5 provider can drive it.
    pub mlx5: bool,
    /// Its ports.
    pub ports: Vec<RdmaPort>,
}

/// The default sysfs directory of RDMA devices.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// Lists RDMA devices under `root` (normally [`SYSFS_INFINIBAND`]). A missing directory is an
/// empty list; unreadable attributes are empty strings. Sorted by name.
pub fn rdma_devices_at(root: &Path) -> Vec<RdmaDevice> {
    let read = |p: PathBuf| fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut devices: Vec<RdmaDevice> = entries
        .flatten()
        .map(|entry| {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let driver = fs::read_link(dir.join("device/driver"))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default();
            let mut ports: Vec<RdmaPort> = fs::read_dir(dir.join("ports"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|p| {
                    let number = p.file_name().to_string_lossy().parse().ok()?;
                    let state = read(p.path().join("state"));
                    let state = state.split_once(": ").map_or(state.clone(), |(_, s)| s.to_string());
                    Some(RdmaPort {
                        number,
                        state,
                        link_layer: read(p.path().join("link_layer")),
                        rate: read(p.path().join("rate")),
                    })
                })
                .collect();
            ports.sort_by_key(|p| p.number);
            let mlx5 = name.starts_with("mlx5") || driver == "mlx5_core";
            RdmaDevice {
                hca_type: read(dir.join("hca_type")),
                fw_ver: read(dir.join("fw_ver")),
                name,
                driver,
                mlx5,
                ports,
            }
        })
        .collect();
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    devices
}

/// Lists this machine's RDMA devices.
pub fn rdma_devices() -> Vec<RdmaDevice> {
    rdma_devices_at(Path::new(SYSFS_INFINIBAND))
}

/// Whether a shared library can be loaded (by `dlopen`), e.g. `libibverbs.so.1`.
pub fn library_loadable(name: &str) -> bool {
    // SAFETY: loading runs the library's initialisers; the verbs and CUDA libraries probed here
    // have none with side effects beyond their own state, and the handle is dropped at once.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// Whether the `nvidia_peermem` kernel module (legacy GPUDirect RDMA registration) is loaded.
pub fn nvidia_peermem_loaded() -> bool {
    Path::new("/sys/module/nvidia_peermem").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_a_fake_sysfs_tree() {
        let root = std::env::temp_dir().join(format!("gdaki-sysfs-{}", std::process::id()));
        let dev = root.join("mlx5_1");
        let port = dev.join("ports/1");
        fs::create_dir_all(&port).unwrap();
        fs::create_dir_all(root.join("rxe0/ports/1")).unwrap();
        fs::write(dev.join("hca_type"), "MT4129\n").unwrap();
        fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        fs::write(port.join("link_layer"), "Ethernet\n").unwrap();
        fs::write(port.join("rate"), "400 Gb/sec (4X NDR)\n").unwrap();
        let devices = rdma_devices_at(&root);
        fs::remove_dir_all(&root).unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].name, "mlx5_1");
        assert!(devices[0].mlx5);
        assert_eq!(devices[0].hca_type, "MT4129");
        assert_eq!(
            devices[0].ports,
            [RdmaPort {
                number: 1,
                state: "ACTIVE".into(),
                link_layer: "Ethernet".into(),
                rate: "400 Gb/sec (4X NDR)".into()
            }]
        );
        assert!(!devices[1].mlx5, "rxe is not an mlx5 device");
    }

    #[test]
    fn missing_sysfs_is_no_devices() {
        assert!(rdma_devices_at(Path::new("/nonexistent/gdaki")).is_empty());
    }
}
