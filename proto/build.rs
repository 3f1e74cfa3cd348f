//! Compiles `parse/v1/*.proto` (needs `protoc`: Debian's `protobuf-compiler` and `libprotobuf-dev`) and writes the
//! file descriptor set that server reflection serves.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("parse_v1_descriptor.bin"))
        .compile_protos(
            &[
                "parse/v1/generation.proto",
                "parse/v1/worker.proto",
                "parse/v1/admin.proto",
            ],
            &["."],
        )?;
    println!("cargo:rerun-if-changed=parse/v1");
    Ok(())
}
