//! `sock_bw`: socket bandwidth, next to put_bw's on the same queue pairs and memory (docs/sockets.md; `sock_bw --help`).
fn main() {
    gdaki_examples::sock::program(gdaki_examples::sock::Test::Bw);
}
