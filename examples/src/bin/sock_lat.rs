//! `sock_lat`: socket latency, next to write_lat's on the same queue pairs and memory (docs/sockets.md; `sock_lat --help`).
fn main() {
    gdaki_examples::sock::program(gdaki_examples::sock::Test::Lat);
}
