//! Streams for `--stream` (stream-triggered posting, `gdaki::stream`): where a side's stream
//! work runs, a CUDA stream in GPU mode or a CPU thread's stream in CPU mode, and the marks
//! (CUDA events, or the CPU stream's) that time it.
use anyhow::bail;
use gdaki::stream::{CpuStream, CudaStreamOps, MemOps};

/// A stream of one side (or one queue pair) and the marks it left.
pub enum Executor {
    /// A CUDA stream, timed by events recorded on it.
    Cuda {
        /// The stream.
        ops: CudaStreamOps,
        /// One event per mark, in order.
        marks: Vec<gdaki::cuda::CudaEvent>,
    },
    /// A CPU thread's stream, timed by its marks.
    Cpu(CpuStream),
}

impl Executor {
    /// A new stream on `gpu` (a CUDA stream of its own), or a CPU stream whose waits give up
    /// after `cpu_timeout`.
    pub fn new(gpu: Option<&gdaki::cuda::Gpu>, cpu_timeout: std::time::Duration) -> anyhow::Result<Executor> {
        Ok(match gpu {
            Some(gpu) => Executor::Cuda {
                ops: CudaStreamOps::new(gpu, gpu.context().new_stream()?)?,
                marks: Vec::new(),
            },
            None => Executor::Cpu(CpuStream::new(cpu_timeout)?),
        })
    }

    /// The executor the stream queue pairs enqueue to.
    pub fn ops(&mut self) -> &mut dyn MemOps {
        match self {
            Executor::Cuda { ops, .. } => ops,
            Executor::Cpu(s) => s,
        }
    }

    /// Enqueues a mark: the time the stream gets there.
    pub fn mark(&mut self) -> anyhow::Result<()> {
        match self {
            Executor::Cuda { ops, marks } => marks.push(gdaki::cuda::record_event(ops.stream())?),
            Executor::Cpu(s) => s.mark()?,
        }
        Ok(())
    }

    /// Waits (at most `timeout`) for the stream's work; the times of its marks (ns, the first
    /// 0), which it forgets.
    pub fn finish(&mut self, timeout: std::time::Duration) -> anyhow::Result<Vec<u64>> {
        match self {
            Executor::Cuda { ops, marks } => {
                if !gdaki::cuda::stream_idle_within(ops.stream(), timeout)? {
                    bail!("the stream did not finish within {timeout:?} (a message or a completion never came)");
                }
                let mut times = vec![0u64];
                for w in marks.windows(2) {
                    let ms = w[0].elapsed_ms(&w[1])?;
                    times.push(times[times.len() - 1] + (f64::from(ms) * 1e6) as u64);
                }
                if marks.is_empty() {
                    times.clear();
                }
                marks.clear();
                Ok(times)
            }
            Executor::Cpu(s) => {
                s.synchronize()?;
                let marks = s.take_marks();
                let first = marks.first().copied();
                Ok(marks
                    .into_iter()
                    .map(|t| first.map_or(0, |f| t.duration_since(f).as_nanos() as u64))
                    .collect())
            }
        }
    }
}
