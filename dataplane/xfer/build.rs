//! Build script: with the `rdma` feature, compiles the small C layer over libibverbs
//! (Debian: libibverbs-dev) and links it; without it, does nothing.

fn main() {
    println!("cargo:rerun-if-changed=csrc/kvx_rdma.c");
    #[cfg(feature = "rdma")]
    {
        cc::Build::new().file("csrc/kvx_rdma.c").warnings(true).compile("kvx_rdma");
        println!("cargo:rustc-link-lib=ibverbs");
    }
}
