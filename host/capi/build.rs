//! Gives libgdaki.so its SONAME: libgdaki.so.<GDAKI_ABI_VERSION> (a program linked against one
//! ABI refuses to load another). The C test checks the two agree.
fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgdaki.so.1");
    }
}
