//! `sock_bw`: socket bandwidth, next to put_bw's on the same queue pairs and memory (docs/sockets.md).
use clap::Parser;

/// Streams messages through a gdaki socket (GPUnet's model) and reports bandwidth beside RDMA WRITEs on the same path.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: gdaki_examples::sock::SockArgs,
}

fn main() {
    gdaki_examples::init_tracing();
    let cli = Cli::parse();
    if let Err(e) = gdaki_examples::sock::main(gdaki_examples::sock::Test::Bw, cli.args) {
        eprintln!("sock_bw: {}", gdaki_examples::error_text(&e));
        std::process::exit(1);
    }
}
