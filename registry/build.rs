//! When RocksDB is linked statically (`ROCKSDB_STATIC`, as scripts/lib.sh does with
//! Debian's librocksdb.a), link the compression libraries it was built with. They are
//! passed as trailing link arguments so they follow the archive that needs them.
//! Measured (BENCHMARKS.md): static linking takes the idle resident set from 18 MiB
//! (shared librocksdb, relocated at load) to well under half of that.

fn main() {
    println!("cargo:rerun-if-env-changed=ROCKSDB_STATIC");
    if std::env::var_os("ROCKSDB_STATIC").is_some() {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--as-needed");
        for lib in ["snappy", "lz4", "zstd", "bz2", "z", "gflags", "stdc++"] {
            println!("cargo:rustc-link-arg=-l{lib}");
        }
        println!("cargo:rustc-link-arg=-Wl,--pop-state");
        // Debian's archive holds position-dependent code: link a position-dependent
        // executable, so its text is mapped clean from the file and paged in only where
        // it runs (a PIE would need text relocations, dirtying every page at start).
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}
