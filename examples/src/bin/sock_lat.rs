//! `sock_lat`: socket latency, next to write_lat's on the same queue pairs and memory (docs/sockets.md).
use clap::Parser;

/// Ping-pongs messages through a gdaki socket (GPUnet's model) and reports one-way latency beside write_lat's on the same path.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: gdaki_examples::sock::SockArgs,
}

fn main() {
    gdaki_examples::init_tracing();
    let cli = Cli::parse();
    if let Err(e) = gdaki_examples::sock::main(gdaki_examples::sock::Test::Lat, cli.args) {
        eprintln!("sock_lat: {}", gdaki_examples::error_text(&e));
        std::process::exit(1);
    }
}
