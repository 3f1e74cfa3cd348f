//! Compiles `parse/v1/*.proto` with `protox` (a protobuf compiler in Rust, so the build needs no system `protoc`) and
//! writes the file descriptor set that server reflection serves.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let fds = protox::compile(
        [
            "parse/v1/generation.proto",
            "parse/v1/worker.proto",
            "parse/v1/admin.proto",
        ],
        ["."],
    )?;
    std::fs::write(out.join("parse_v1_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    println!("cargo:rerun-if-changed=parse/v1");
    Ok(())
}
