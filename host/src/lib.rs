//! `gdaki`: the host library of the gdaki kernel-initiated RDMA runtime.
//!
//! The host does the control phase once (open a provider, register memory, create and connect
//! queues, export them to the GPU); GPU kernels built from `gdaki-device` then drive the HCA
//! themselves. This crate also embeds the device crate's PTX ([`ptx`]), talks to the CUDA driver
//! through run-time loading ([`cuda`], no CUDA needed to build) and describes what the machine
//! offers ([`system`], [`provider`]), which is what `doctor` reports.
#![warn(missing_docs)]

pub mod cuda;
pub mod provider;
pub mod ptx;
pub mod system;

pub use provider::{DoorbellHandler, ExecutionMode, Provider, Selection};
